"""Frozen engine configs, validated once at construction.

Values found at run time (the number of KV blocks, say) live in the objects that own them,
not here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

# vLLM's names: "auto" is the model's dtype, "fp8" the same as "fp8_e4m3".
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
LOAD_FORMATS = ("auto", "dummy")  # read the weights; random ones


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


# Seconds an engine loop (`octavo serve`, AsyncEngine) waits idle before it gives the memory
# of free KV blocks back on the CPU (engine_loop.IdleRelease).
DEFAULT_KV_IDLE_RELEASE_S = 30.0


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size, the memory budget that sizes the pool, and the dtype
    its keys and values are stored in (`cache_dtype`, one of KV_CACHE_DTYPES).

    Exactly one budget applies, in this order: `num_kv_blocks` if given, else
    `kv_cache_memory` bytes if given, else `gpu_memory_utilization` of the GPU (CUDA) or
    a default of 1 GiB (CPU).

    `sliding_window` is the model's (the builder sets it) where every layer slides: blocks
    wholly before the window go back to the pool during a request. `hybrid_window` is the
    sliding layers' window where the other layers attend to everything (Gemma 2 and 3): the
    sliding layers keep their blocks apart, and give back those before it
    (core/hybrid_kv.py).
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    cache_dtype: str = "auto"
    sliding_window: int | None = None
    hybrid_window: int | None = None

    def __post_init__(self) -> None:
        _check_positive("block_size", self.block_size)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None:
            _check_positive("num_kv_blocks", self.num_kv_blocks)
        if self.kv_cache_memory is not None:
            _check_positive("kv_cache_memory", self.kv_cache_memory)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.cache_dtype!r}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step budgets: at most `max_num_seqs` running requests and
    `max_num_batched_tokens` tokens computed in one step; prompts up to `max_model_len`."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        _check_positive("max_num_seqs", self.max_num_seqs)
        _check_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _check_positive("max_model_len", self.max_model_len)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "max_num_batched_tokens must be >= max_model_len when chunked prefill is off"
            )


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism over `tensor_parallel_size` ranks, spread evenly over `nnodes`
    machines that meet at `dist_init_addr` ("host:port" of node 0); a size of 1 runs in
    this process without any process group."""

    tensor_parallel_size: int = 1
    nnodes: int = 1
    dist_init_addr: str | None = None
    enable_expert_parallel: bool = False  # MoE layers: whole experts per rank (model/moe.py)

    def __post_init__(self) -> None:
        _check_positive("tensor_parallel_size", self.tensor_parallel_size)
        _check_positive("nnodes", self.nnodes)
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"nnodes={self.nnodes} does not divide "
                f"tensor_parallel_size={self.tensor_parallel_size}"
            )
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("nnodes > 1 needs dist_init_addr (HOST:PORT of node 0)")


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, with vLLM's fields: a proposer guesses up to
    `num_speculative_tokens` next tokens of a decoding request, and one step of the model
    checks them all (engine/speculative.py).

    - `method="ngram"`: prompt lookup. The last n tokens (n from `prompt_lookup_max` down
      to `prompt_lookup_min`) are looked for earlier in the sequence; the tokens that
      followed their latest earlier occurrence are the guess.
    - `method="draft_model"`: a smaller model `model` of the same vocabulary guesses
      greedily, with a KV cache of its own in the same block positions.

    Speculation is off for a step that runs more than `disable_by_batch_size` requests,
    where verifying guesses costs more than it saves (None: the device's measured default,
    engine/builder.py's SPEC_MAX_BATCH).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config's method must be one of {SPECULATIVE_METHODS}, "
                f"got {self.method!r}"
            )
        _check_positive("num_speculative_tokens", self.num_speculative_tokens)
        _check_positive("prompt_lookup_max", self.prompt_lookup_max)
        _check_positive("prompt_lookup_min", self.prompt_lookup_min)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min={self.prompt_lookup_min} exceeds "
                f"prompt_lookup_max={self.prompt_lookup_max}"
            )
        if self.disable_by_batch_size is not None:
            _check_positive("disable_by_batch_size", self.disable_by_batch_size)
        if self.method == "draft_model" and not self.model:
            raise ValueError('speculative_config with method "draft_model" needs a "model"')
        if self.method == "ngram" and self.model is not None:
            raise ValueError('speculative_config: "model" is for method "draft_model"')

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From LLM()'s dict, the CLI's JSON text, or a SpeculativeConfig; None stays None.
        Unknown fields are a ValueError that names them."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(
                f"speculative_config must be a dict (JSON object), got {type(value).__name__}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown field(s) {unknown}; known: {sorted(known)}"
            )
        return cls(**value)
