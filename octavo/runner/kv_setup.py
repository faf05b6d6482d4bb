"""Start-up of a model runner: how many KV blocks fit, and warming up the kernels a run will
launch, so that none loads in the middle of it."""

from __future__ import annotations

import ctypes
import math
import mmap
import sys
from collections.abc import Callable

import torch
from torch import nn

from octavo.attention.backend import AttentionBackend, build_metadata
from octavo.attention.layer import bind_kv_caches
from octavo.config import CacheConfig
from octavo.core.hybrid_kv import sliding_pool_blocks
from octavo.kernels.capability import check_fp8_device
from octavo.model.config import get_head_dim, get_num_kv_heads, hybrid_window, layer_windows
from octavo.model.layers import Linear
from octavo.model.parallel import get_tp, kv_head_range
from octavo.runner.host_copy import to_device
from octavo.runner.inputs import InputBuilder
from octavo.runner.sampler import Sampler
from octavo.runner.sampling_metadata import SamplingMetadata
from octavo.sampling_params import SamplingParams

CPU_DEFAULT_KV_BYTES = 1 << 30


def kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """CacheConfig.cache_dtype as a torch dtype: "auto" is the model's; "fp8" and "fp8_e4m3"
    are float8_e4m3fn, one byte an element, so a block takes half of bfloat16's memory.
    Raises ValueError for fp8 on a CUDA GPU without FP8 (below compute capability 8.9)."""
    if name == "auto":
        return model_dtype
    check_fp8_device(f"kv_cache_dtype={name!r}", device)
    return torch.float8_e4m3fn


def zeroed_kv_cache(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """One layer's KV cache tensor, all zeros.

    NOTE: the cache must start as zeros, not as whatever memory held: the torch backend's
    decode gathers whole blocks, past each context too, and masked slots holding NaN would
    still turn the output into NaN. On the CPU the zeros come from an anonymous memory map,
    whose pages the kernel zeroes on first touch: start-up writes nothing, and only the
    blocks in use take memory.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    private = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}
    pages = mmap.mmap(-1, math.prod(shape) * dtype.itemsize, **private)  # anonymous: zeros
    return torch.frombuffer(pages, dtype=dtype).view(shape)  # keeps `pages` alive


def release_kv_pages(
    caches: list[torch.Tensor], kinds: list[bool], ids: dict[bool, list[int]]
) -> int:
    """Gives the memory pages of free blocks back to the operating system (Linux, CPU
    caches: `madvise(MADV_DONTNEED)` on zeroed_kv_cache's private mapping, which reads as
    zeros again and is mapped afresh when next written). `ids[kind]` are the blocks of the
    layers of that kind (sliding_layers). Only whole pages inside a run of consecutive
    blocks are given back. Returns the bytes given back."""
    # NOTE: Linux only: elsewhere MADV_DONTNEED need not zero nor free private pages.
    if not caches or caches[0].device.type != "cpu" or not sys.platform.startswith("linux"):
        return 0
    madvise, page, released = _libc().madvise, mmap.PAGESIZE, 0
    for cache, kind in zip(caches, kinds, strict=True):
        block = cache.stride(1) * cache.element_size()  # [2, num_blocks, ...]
        for half in (0, 1):
            base = cache.data_ptr() + half * cache.stride(0) * cache.element_size()
            for first, count in _runs(ids[kind]):
                start = -(-(base + first * block) // page) * page
                end = (base + (first + count) * block) // page * page
                if end > start and madvise(start, end - start, mmap.MADV_DONTNEED) == 0:
                    released += end - start
    return released


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """Runs of consecutive block ids as (first, count)."""
    runs: list[tuple[int, int]] = []
    for i in sorted(ids):
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def _libc():
    lib = ctypes.CDLL(None, use_errno=True)
    lib.madvise.argtypes = [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int]
    return lib


def kv_cache_shape(hf_config, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """One layer's cache: [2 (K, V), num_blocks, block_size, this rank's KV heads, head_dim]
    (all the KV heads at world size 1)."""
    tp = get_tp()
    kv_heads = kv_head_range(get_num_kv_heads(hf_config), tp.rank, tp.size)[1]
    return (2, num_blocks, block_size, kv_heads, get_head_dim(hf_config))


def kv_bytes_per_block(
    hf_config, block_size: int, dtype: torch.dtype, layers: int | None = None
) -> int:
    """layers (all by default) x one block of kv_cache_shape x dtype bytes."""
    layers = hf_config.num_hidden_layers if layers is None else layers
    return layers * math.prod(kv_cache_shape(hf_config, 1, block_size)) * dtype.itemsize


def sliding_layers(hf_config) -> list[bool]:
    """Which layers keep their blocks in the sliding layers' pool (core/hybrid_kv.py): the
    sliding ones of a model with both kinds; none in other models."""
    if hybrid_window(hf_config) is None:
        return [False] * hf_config.num_hidden_layers
    return [window is not None for window in layer_windows(hf_config)]


def sliding_pool_size(
    hf_config, num_blocks: int | None, block_size: int, seqs: int, tokens: int
) -> int | None:
    """The sliding layers' pool for `num_blocks` full blocks, `seqs` sequences and `tokens`
    tokens a step (hybrid_kv.sliding_pool_blocks); None where the model has one kind."""
    window = hybrid_window(hf_config)
    if window is None:
        return None
    return sliding_pool_blocks(num_blocks, window, block_size, seqs, tokens)


def pool_block_bytes(hf_config, block_size: int, dtype, seqs: int, tokens: int):
    """(bytes of a block on the layers of the full pool, None or (bytes of a block on the
    sliding layers, the most blocks their pool needs)): num_kv_blocks' arguments."""
    sliding = sliding_layers(hf_config)
    per_block = kv_bytes_per_block(hf_config, block_size, dtype, sliding.count(False))
    most = sliding_pool_size(hf_config, None, block_size, seqs, tokens)
    if most is None:
        return per_block, None
    return per_block, (kv_bytes_per_block(hf_config, block_size, dtype, sliding.count(True)), most)


def allocate_kv_caches(
    hf_config, num_blocks: int, num_sliding: int | None, block_size: int, dtype, device
) -> list[torch.Tensor]:
    """One zeroed cache per layer (kv_cache_shape), each with one block past its pool as
    scratch space for CUDA-graph padding rows: `num_sliding` + 1 blocks on the layers of the
    sliding layers' pool, `num_blocks` + 1 on the others."""
    return [
        zeroed_kv_cache(
            kv_cache_shape(hf_config, (num_sliding if sliding else num_blocks) + 1, block_size),
            dtype,
            device,
        )
        for sliding in sliding_layers(hf_config)
    ]


def copy_blocks(caches, hf_config, copies, sliding, device) -> tuple | None:
    """Copies blocks (source, destination) in every layer's cache: `copies` in the full pool,
    `sliding` in the sliding layers' pool (core/hybrid_kv.py). Returns the full pool's pairs
    as (sources, destinations) device tensors, for a draft model's cache; None if none."""
    kinds, full = sliding_layers(hf_config), None
    for pairs, kind in ((copies, False), (sliding, True)):
        if not pairs:
            continue
        src, dst = to_device([list(c) for c in zip(*pairs)], torch.int64, device)
        for cache in (c for c, k in zip(caches, kinds, strict=True) if k == kind):
            cache[:, dst] = cache[:, src]  # [2, num_blocks, block_size, KVH, D]
        full = full if kind else (src, dst)
    return full


def num_kv_blocks(
    cache: CacheConfig,
    per_block: int,
    device: torch.device,
    activation_bytes: Callable[[], int],
    sliding: tuple[int, int] | None = None,
) -> int:
    """Sizes the block pool from the budget in CacheConfig, `per_block` bytes a block. On
    CUDA the budget is `gpu_memory_utilization` of the GPU minus what is in use after loading
    the model (by us and others) and the peak activations of the largest step
    (`activation_bytes()`, a profiling pass).

    With `sliding` = (bytes a block of the sliding layers' pool, the most blocks that pool
    needs), `per_block` counts the other layers only: the sliding pool takes its most first,
    the full layers the rest (both pools as large where the budget holds no more)."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    if cache.kv_cache_memory is not None:
        budget = cache.kv_cache_memory
    elif device.type == "cuda":
        activations = activation_bytes()
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * cache.gpu_memory_utilization) - (total - free) - activations
        # CUDA graphs and the allocator's fragmentation need some room too.
        budget -= 1 << 30
    else:
        budget = CPU_DEFAULT_KV_BYTES
    num_blocks = budget // per_block
    if sliding is not None:
        per_sliding, most = sliding
        num_blocks = (budget - per_sliding * most) // per_block
        if num_blocks < most:
            num_blocks = budget // (per_block + per_sliding)
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache budget ({budget} bytes) is smaller than one block ({per_block} bytes)"
        )
    return num_blocks


@torch.inference_mode()
def profile_activation_bytes(
    model: nn.Module,
    backend: AttentionBackend,
    kv_shape: tuple[int, ...],
    kv_dtype: torch.dtype,
    device: torch.device,
    num_tokens: int,
    num_rows: int,
) -> int:
    """Peak memory of one step's activations: a forward pass over `num_tokens` tokens and
    logits for `num_rows` rows, over temporary KV caches of `kv_shape` (just large enough),
    unbound and freed again before the GPU's free memory is read."""
    num_blocks, block_size = kv_shape[1], kv_shape[2]
    layers = model.config.num_hidden_layers
    caches = [zeroed_kv_cache(kv_shape, kv_dtype, device) for _ in range(layers)]
    bind_kv_caches(model, caches, backend)
    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        md = build_metadata(
            [num_tokens], [num_tokens], [list(range(num_blocks))], block_size, device
        )
        ids = torch.randint(0, model.config.vocab_size, (num_tokens,), device=device)
        # NOTE: a step's tokens may outnumber the rotary table's positions (8,192 against a
        # model's 2,048): past it a rotary kernel would read outside the table.
        pos = torch.arange(num_tokens, device=device) % model.config.max_position_embeddings
        hidden = model(ids, pos, md)
        model.compute_logits(hidden[:num_rows].repeat(-(-num_rows // num_tokens), 1))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(device) - base
    finally:
        bind_kv_caches(model, [None] * layers, backend)  # the layers hold no cache of ours
        del caches
        torch.cuda.empty_cache()
    return peak


def warm_up_rows(max_rows: int, per_doubling: int = 8) -> list[int]:
    """Row counts for warm_up_linears: 1-16, then `per_doubling` sizes per doubling up to
    `max_rows`, each as a multiple of 8 and as the odd count after it, and `max_rows`."""
    rows = set(range(1, min(16, max_rows) + 1)) | {max_rows}
    size = 16.0
    while size < max_rows:
        aligned = int(size) // 8 * 8
        rows.update(r for r in (aligned, aligned + 1) if r <= max_rows)
        size *= 2 ** (1 / per_doubling)
    return sorted(rows)


@torch.inference_mode()
def warm_up_linears(model: torch.nn.Module, max_rows: int) -> int:
    """Runs each distinct projection of `model` (by weight shape, dtype and bias) once at
    every row count of warm_up_rows(max_rows), on zeros; returns the number of GEMMs run.

    NOTE: cuBLAS picks a GEMM kernel by shape, and the first launch of each kernel stalls
    the host for milliseconds. A prefill step's row count is its token count, so without
    this the first steps after start-up, each with a new token count, would add those stalls
    to their TTFT (docs/PERFORMANCE.md). The inputs are contiguous [rows, in] views, like the
    activations, since cuBLAS may pick another kernel for another row stride.
    """
    linears: dict[tuple, Linear] = {}
    for module in model.modules():
        if isinstance(module, Linear):
            w = module.weight if module.quant is None else module.quant.qweight
            linears.setdefault((tuple(w.shape), w.dtype, module.bias is not None), module)
    flats: dict[torch.dtype, torch.Tensor] = {}  # one zero input buffer per activation dtype
    for module in linears.values():
        dtype, size = _input_dtype(module), max_rows * module.input_size
        if dtype not in flats or flats[dtype].numel() < size:
            device = next(module.parameters()).device
            flats[dtype] = torch.zeros(size, dtype=dtype, device=device)
    launched = 0
    for rows in warm_up_rows(max_rows):
        for module in linears.values():
            flat = flats[_input_dtype(module)]
            module(flat[: rows * module.input_size].view(rows, module.input_size))
            launched += 1
    return launched


def _input_dtype(module: Linear) -> torch.dtype:
    """The activations' dtype: the weight's, or the one a quantized weight was made from."""
    return module.weight.dtype if module.quant is None else module.quant.dtype


@torch.inference_mode()
def warm_up_eager_decode(
    model: nn.Module, inputs: InputBuilder, dtype: torch.dtype, max_num_seqs: int
) -> None:
    """Runs the eager end of a decode step (LM head, sampler, pending-token copy) once
    for every batch size a step can have: all rows greedy, then random and greedy rows
    in turn (a batch of one: random).

    NOTE: cuBLAS and torch pick their kernels by shape and alignment, and CUDA loads a
    kernel's module at its first launch (lazy loading). Without this, a run whose batch
    shrinks from 256 to 1 loads new kernels on the way, each stalling the host between two
    steps (docs/PERFORMANCE.md). A sampler and a
    generator of its own leave the engine's and torch's random streams untouched. Rows
    with filters, penalties or log-probs take other kernels, which this does not load.
    """
    sampler = Sampler(seed=0)
    device, config = inputs.device, model.config
    noise = torch.Generator(device).manual_seed(0)
    hidden = torch.randn(
        max_num_seqs, config.hidden_size, dtype=dtype, device=device, generator=noise
    )
    greedy, random_row = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)
    mixed = [random_row if i % 2 == 0 else greedy for i in range(max_num_seqs)]
    for params in ([greedy] * max_num_seqs, mixed):
        for batch in range(1, max_num_seqs + 1):
            empty = [[]] * batch  # no prompt or output tokens: nothing reads them
            md = SamplingMetadata.build(params[:batch], empty, empty, config.vocab_size, device)
            sampled = sampler(model.compute_logits(hidden[:batch]), md)
            index = torch.arange(batch, device=device).repeat(2, 1)  # [2, batch]
            inputs.copy_pending(index, sampled.sampled_token_ids)
    torch.cuda.synchronize()
