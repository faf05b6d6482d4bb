"""From user options to a running Engine: resolve the model, size the KV cache."""

from __future__ import annotations

import dataclasses
import logging
import os
from importlib import resources

import torch

from octavo.checkpoint.embedded import embedded_model_path
from octavo.checkpoint.hf_config import load_hf_config
from octavo.checkpoint.hub import download, looks_like_hub_id
from octavo.config import (
    LOAD_FORMATS,
    CacheConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from octavo.engine.engine import Engine
from octavo.engine.gc_heap import frozen_gc_heap
from octavo.engine.speculative import Speculator
from octavo.kernels.capability import AUTO_THREADS, ThreadGovernor, cpu_threads
from octavo.kernels.cpu import compute_mode
from octavo.model.config import get_head_dim, get_num_kv_heads, hybrid_window, layer_windows
from octavo.model.parallel import check_tp_size
from octavo.quant import get_method, resolve_quantization
from octavo.runner import kv_setup
from octavo.runner.draft import DraftOptions
from octavo.runner.interface import Runner
from octavo.runner.model_runner import ModelRunner
from octavo.runner.multiproc import MultiprocRunner
from octavo.tokenizer.tokenizer import eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def bundled_config_names() -> list[str]:
    """Benchmark configs shipped in the package (octavo/configs/<name>/config.json)."""
    root = resources.files("octavo") / "configs"
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def resolve_model(model: str | None, revision: str | None = None) -> str:
    """None -> the embedded SmolLM2 GGUF; a bundled config name -> its directory; a hub id
    (`org/name`) -> its files in the Hugging Face cache, downloaded if need be."""
    if model is None:
        return embedded_model_path()
    if model in bundled_config_names():
        return str(resources.files("octavo") / "configs" / model)
    if looks_like_hub_id(model):
        return download(model, revision)
    if not os.path.exists(model):
        raise ValueError(
            f"model {model!r} is neither a path, a hub id (org/name) nor a bundled config "
            f"({', '.join(bundled_config_names())})"
        )
    return model


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device {device!r} is not a torch device") from e
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but CUDA is not available")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' is bfloat16 on CUDA and float32 on the CPU."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {dtype}")
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {list(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


# Tokens a step computes by default. On the CPU a step of 128 tokens takes 0.16 s (0.6 s at
# 8k tokens of context) on 2 cores, so a long prompt's prefill lets other requests in
# between its chunks; a larger step gains no throughput there (docs/PERFORMANCE.md).
CPU_STEP_TOKENS = 128
GPU_STEP_TOKENS = 8192


# Speculative decoding's default `disable_by_batch_size`. CPU: the largest batch at which
# n-gram guesses still paid on input-grounded prompts (benchmarks/spec_decode.py --batch,
# docs/PERFORMANCE.md). CUDA: where a verify step of k = 4 stays memory-bound on an H100 or
# H200 (32 x 5 = 160 rows, below the ~300 rows at which a bf16 GEMM turns compute-bound),
# until benchmarks/spec_latency.py --batch measures it.
SPEC_MAX_BATCH = {"cpu": 16, "cuda": 32}


# The heap from before (the libraries: hundreds of thousands of objects) is hidden from the
# garbage collector while the engine is built, so that collections the build sets off are short.
@frozen_gc_heap()
def build_engine(
    model: str | None = None,
    tokenizer: str | None = None,
    dtype: str | torch.dtype = "auto",
    device: str = "auto",
    max_model_len: int | None = None,
    block_size: int = 16,
    num_kv_blocks: int | None = None,
    kv_cache_memory: int | None = None,
    gpu_memory_utilization: float = 0.9,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int | None = None,
    enable_prefix_caching: bool = True,
    enforce_eager: bool = False,
    cuda_graph_max_tokens: int = 512,
    tensor_parallel_size: int = 1,
    nnodes: int = 1,
    dist_init_addr: str | None = None,
    load_format: str = "auto",
    quantization: str | None = "auto",
    kv_cache_dtype: str = "auto",
    seed: int = 0,
    attention_backend: str | None = None,
    async_scheduling: bool | None = None,
    threads: int | None = None,
    enable_expert_parallel: bool = False,
    speculative_config: SpeculativeConfig | dict | str | None = None,
    revision: str | None = None,
    deterministic: bool = False,
) -> Engine:
    """Builds an Engine from LLM()'s options (the README's table gives their meaning)."""
    speculative = _check_options(load_format, cuda_graph_max_tokens, speculative_config)
    parallel = ParallelConfig(tensor_parallel_size, nnodes, dist_init_addr, enable_expert_parallel)
    hf_config = load_hf_config(model_path := resolve_model(model, revision))
    cache = _cache_config(hf_config, block_size, num_kv_blocks, kv_cache_memory,
                          gpu_memory_utilization, enable_prefix_caching, kv_cache_dtype)  # fmt: skip
    dev = _device_with_threads(device, threads)
    _check_parallel(parallel, hf_config, dev)
    quantization = _quantization(quantization, model_path, hf_config, dev, load_format)
    torch_dtype = resolve_dtype(dtype, dev)
    kv_dtype = kv_setup.kv_cache_dtype(cache.cache_dtype, torch_dtype, dev)
    mode = _compute_mode(dev, torch_dtype, kv_dtype, quantization, hf_config, deterministic)
    tok = load_tokenizer(resolve_model(tokenizer, revision) if tokenizer else model_path)
    runner_options = {
        "model_path": model_path, "hf_config": hf_config, "dtype": torch_dtype,
        "block_size": block_size, "load_format": load_format, "seed": seed,
        "attention_backend": attention_backend, "enforce_eager": enforce_eager,
        "cuda_graph_max_tokens": cuda_graph_max_tokens, "quantization": quantization,
        "kv_cache_dtype": kv_dtype, "deterministic": deterministic,
        "draft": _draft_options(speculative, hf_config, dev, parallel, load_format),
    }  # fmt: skip
    runner = _make_runner(runner_options, dev, parallel, threads)
    sched, num_blocks = _allocate_kv_cache(
        runner, cache, hf_config, dev, max_model_len, max_num_seqs, max_num_batched_tokens
    )
    overlap = dev.type == "cuda" if async_scheduling is None else async_scheduling
    eos = eos_token_ids(tok, getattr(hf_config, "eos_token_id", None))
    return Engine(runner, tok, cache, sched, num_blocks, eos, overlap, mode,
                  _speculator(speculative, dev))  # fmt: skip


def _cache_config(hf_config, *options) -> CacheConfig:
    """The cache options, and the model's window where every layer slides or where some do
    (the blocks before it are given back during a request)."""
    windows = layer_windows(hf_config)
    sliding = None if None in windows else max(windows)
    return CacheConfig(*options, sliding_window=sliding, hybrid_window=hybrid_window(hf_config))


def _compute_mode(dev, dtype, kv_dtype, quantization, hf_config, deterministic: bool):
    """(the products' dtype, whether a token's result is independent of the batch);
    ValueError for deterministic=True where the CPU path cannot promise it."""
    packed = quantization not in (None, "fp8")  # fp8 is emulated in float off the GPU
    mode = compute_mode(dev, dtype, kv_dtype, packed, get_head_dim(hf_config))
    if not deterministic or dev.type == "cuda":
        return (mode[0], True) if deterministic else mode
    if not mode[1]:
        raise ValueError(
            "deterministic=True on the CPU needs float32 products and a float32 KV cache "
            "through octavo's C kernels (dtype='float32', no fp8 KV cache, a C compiler)"
        )
    return mode


def _speculator(speculative: SpeculativeConfig | None, dev: torch.device) -> Speculator | None:
    """The engine's speculation, its batch limit the device's default unless given."""
    if speculative is None:
        return None
    if speculative.disable_by_batch_size is None:
        limit = SPEC_MAX_BATCH[dev.type]
        speculative = dataclasses.replace(speculative, disable_by_batch_size=limit)
    return Speculator(speculative)


def _draft_options(
    speculative: SpeculativeConfig | None,
    hf_config,
    dev: torch.device,
    parallel: ParallelConfig,
    load_format: str,
) -> DraftOptions | None:
    """A draft model's path, config and quantization (its checkpoint's own, as "auto"
    picks for a target), None without one; ValueError if it cannot draft for the target."""
    if speculative is None or speculative.method != "draft_model":
        return None
    if parallel.tensor_parallel_size > 1:
        raise ValueError("a draft model runs with tensor_parallel_size=1 (n-gram speculation "
                         "runs with any)")  # fmt: skip
    if hybrid_window(hf_config) is not None:  # its cache would follow two tables of ours
        raise ValueError("a draft model does not draft yet for a target whose layers attend "
                         "two ways (Gemma 2 and 3); n-gram speculation does")  # fmt: skip
    path = resolve_model(speculative.model)
    config = load_hf_config(path)
    if config.vocab_size != hf_config.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({config.vocab_size} tokens) is not the target's "
            f"({hf_config.vocab_size}): a draft must share the target's tokenizer"
        )
    quantization = _quantization("auto", path, config, dev, load_format)
    return DraftOptions(path, config, quantization, speculative.num_speculative_tokens)


def _device_with_threads(device: str, threads: int | None) -> torch.device:
    """The device; on the CPU, torch's thread count set (a process-wide setting: the
    products run on torch's threads) from `threads` or its defaults (cpu_threads)."""
    dev = resolve_device(device)
    if dev.type == "cpu":
        torch.set_num_threads(cpu_threads(threads)[0])
    return dev


def _allocate_kv_cache(
    runner: Runner,
    cache: CacheConfig,
    hf_config,
    dev: torch.device,
    max_model_len: int | None,
    max_num_seqs: int,
    step_tokens: int | None,
) -> tuple[SchedulerConfig, int]:
    """Sizes the KV cache (profiling a step on CUDA) and allocates it once; returns the
    scheduler's budgets (`step_tokens` None: the device's default) and the block count."""
    if step_tokens is None:
        step_tokens = CPU_STEP_TOKENS if dev.type == "cpu" else GPU_STEP_TOKENS
    num_blocks = runner.num_kv_blocks(cache, step_tokens, max_num_seqs)
    model_len = _max_model_len(hf_config, max_model_len, num_blocks * cache.block_size)
    sched = SchedulerConfig(max_num_seqs, step_tokens, model_len)
    runner.allocate_kv_cache(num_blocks, max_num_seqs, sched.max_model_len, step_tokens)
    return sched, num_blocks


def _quantization(quantization, model_path: str, hf_config, dev, load_format: str) -> str | None:
    """The quantization method's name, checked against the checkpoint and the device before
    anything loads."""
    quantization = resolve_quantization(quantization, model_path, hf_config, dev, load_format)
    get_method(quantization, dev, hf_config, model_path, load_format)
    return quantization


def _check_options(
    load_format: str, cuda_graph_max_tokens: int, speculative_config
) -> SpeculativeConfig | None:
    """ValueError for a bad option; the speculative config parsed."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if isinstance(cuda_graph_max_tokens, bool) or not isinstance(cuda_graph_max_tokens, int):
        raise ValueError(f"cuda_graph_max_tokens must be an int, got {cuda_graph_max_tokens!r}")
    if cuda_graph_max_tokens < 0:
        raise ValueError(f"cuda_graph_max_tokens must be >= 0, got {cuda_graph_max_tokens}")
    return SpeculativeConfig.parse(speculative_config)


def _make_runner(
    runner_options: dict, device: torch.device, parallel: ParallelConfig, threads: int | None
) -> Runner:
    """The model in this process, or a worker process per tensor-parallel rank. On the CPU,
    with no thread count asked for, the runner's threads follow the free cores."""
    if parallel.tensor_parallel_size == 1:
        runner = ModelRunner(device=device, **runner_options)
        if device.type == "cpu" and cpu_threads(threads)[1] == AUTO_THREADS:
            runner.thread_governor = ThreadGovernor(torch.get_num_threads())
        return runner
    return MultiprocRunner(
        runner_options, device.type, parallel.tensor_parallel_size, parallel.nnodes,
        parallel.dist_init_addr, parallel.enable_expert_parallel,
    )  # fmt: skip


def _check_parallel(parallel: ParallelConfig, hf_config, device: torch.device) -> None:
    """Raises ValueError, before any worker starts, if the model cannot be split over
    `tensor_parallel_size` ranks or this node has too few GPUs for its share."""
    size = parallel.tensor_parallel_size
    check_tp_size(hf_config.num_attention_heads, get_num_kv_heads(hf_config), size)
    if hf_config.intermediate_size % size:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the model's intermediate_size "
            f"{hf_config.intermediate_size}"
        )
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", 0)
    if parallel.enable_expert_parallel and experts % size:
        raise ValueError(
            f"enable_expert_parallel over tensor_parallel_size={size} ranks needs a multiple "
            f"of {size} experts; the model has {experts}"
        )
    per_node = size // parallel.nnodes
    if device.type == "cuda" and per_node > torch.cuda.device_count():
        raise ValueError(
            f"tensor_parallel_size={size} over {parallel.nnodes} node(s) needs {per_node} GPUs "
            f"on this node, but {torch.cuda.device_count()} are visible"
        )


def _max_model_len(hf_config, requested: int | None, kv_capacity: int) -> int:
    """The model's limit, and never more than the KV cache holds (else a long request
    could never be admitted). An explicit request beyond either is an error."""
    model_limit = getattr(hf_config, "max_position_embeddings", None) or kv_capacity
    if requested is not None:
        if requested > model_limit:
            raise ValueError(f"max_model_len={requested} exceeds the model's limit {model_limit}")
        if requested > kv_capacity:
            raise ValueError(
                f"max_model_len={requested} does not fit in the KV cache ({kv_capacity} "
                "tokens): raise the cache budget or lower max_model_len"
            )
        return requested
    if kv_capacity < model_limit:
        logger.info("max_model_len limited to the KV cache's %d tokens", kv_capacity)
    return min(model_limit, kv_capacity)
