"""The engine's counters, as `Engine.get_stats()` and /metrics give them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    num_steps: int = 0
    num_tokens_computed: int = 0
    num_generated_tokens: int = 0


def engine_stats(engine) -> dict[str, int | float | str | list]:
    """Counters for users and metrics: preemptions, prefix-cache queries and hits (in
    tokens), KV blocks, queue lengths and throughput counters; and the KV cache's dtype
    (torch's name: "bfloat16", "float8_e4m3fn", ...); the dtype the forward's products
    compute in, and whether a request's tokens and log-probs are independent of what runs
    beside it (batch, preemption, chunking, prefix hits); speculative decoding's guesses
    (`spec_*`) and a mixture of experts' routing (`moe_*`) where they apply."""
    return {
        "num_preemptions": engine.scheduler.num_preemptions,
        "prefix_cache_queries": engine.kv.prefix_cache_queries,
        "prefix_cache_hits": engine.kv.prefix_cache_hits,
        "kv_blocks_total": engine.kv.num_total_blocks,
        "kv_blocks_free": engine.kv.num_free_blocks,
        "num_requests_running": len(engine.scheduler.running),
        "num_requests_waiting": len(engine.scheduler.waiting),
        "num_steps": engine.stats.num_steps,
        "num_tokens_computed": engine.stats.num_tokens_computed,
        "num_generated_tokens": engine.stats.num_generated_tokens,
        "kv_blocks_saved_by_sharing": engine.kv.num_shared_block_refs,
        "kv_blocks_out_of_window": engine.kv.num_out_of_window,
        "kv_blocks_peak_used": engine.kv.sharing.peak_blocks_used,
        "num_cow_copies": engine.kv.sharing.num_cow_copies,
        "kv_cache_dtype": str(engine.runner.kv_cache_dtype).removeprefix("torch."),
        "compute_dtype": str(engine.compute_dtype).removeprefix("torch."),
        "batch_invariant": engine.batch_invariant,
        **(engine.speculator.stats.as_dict() if engine.speculator is not None else {}),
        **_expert_stats(engine.runner),
        **_sliding_pool_stats(engine.kv),
    }


def _sliding_pool_stats(kv) -> dict:
    """The sliding layers' own pool, in a model whose layers attend two ways
    (core/hybrid_kv.py); the other kv_blocks_* figures are the full layers' pool."""
    sliding = getattr(kv, "sliding", None)
    if sliding is None:
        return {}
    return {
        "kv_sliding_blocks_total": sliding.num_total_blocks,
        "kv_sliding_blocks_free": sliding.num_free_blocks,
        "kv_sliding_blocks_peak_used": sliding.sharing.peak_blocks_used,
    }


def _expert_stats(runner) -> dict:
    """A mixture of experts' routing: tokens per expert over all layers, and the most
    loaded expert of any layer against that layer's mean (1.0: even). Only where the
    model runs in this process."""
    load = getattr(runner, "expert_load", None)
    found = load() if load is not None else None
    if found is None:
        return {}
    return {"moe_expert_tokens": found[0], "moe_expert_imbalance": found[1]}
