"""KV blocks for a model whose layers attend two ways (Gemma 2 and 3): full-attention layers
and sliding-window layers, as vLLM's hybrid allocator keeps them, a group per kind.

Each kind has its own pool and its own block table per request; the tables run side by side,
one entry per logical block, so the runner writes both from one index:

    window 8, block_size 4, 13 tokens      full    [3, 8, 1, 6]
                                            sliding [-, -, 5, 2]   (positions 0-7 unseen)

The sliding layers' blocks before the window go back to their pool as the request advances
(KVCacheManager's sliding window), so the sliding pool needs only a window's worth of blocks
for each running sequence (`sliding_pool_blocks`); the memory it does not need goes to the
full layers' pool. The scheduler's capacity check is the pair's: a step fits when both fit.

A prefix hit needs the whole prefix on the full layers and only its last window on the
sliding ones, so it is the longest prefix both pools still hold.
"""

from __future__ import annotations

from octavo.config import CacheConfig, SchedulerConfig
from octavo.core.block_pool import KVBlock
from octavo.core.kv_cache_manager import KVCacheManager
from octavo.core.request import Request

Hits = tuple[list[KVBlock], list[KVBlock | None]]


def sliding_pool_blocks(
    num_blocks: int | None,
    window: int,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> int:
    """Blocks the sliding layers need at most: each running sequence holds at most
    window / block_size + 2 blocks between steps, and a step's new tokens take at most
    max_num_batched_tokens / block_size more; never more than the full layers' pool
    (`num_blocks`; None: before it is sized).

    NOTE: samples of one prompt (n > 1, beam search) run past max_num_seqs, each with its
    window; when they outgrow this pool the scheduler preempts as for any pool that runs
    short, though the full one has room."""
    per_seq = -(-window // block_size) + 2
    most = max_num_seqs * per_seq + -(-max_num_batched_tokens // block_size)
    return most if num_blocks is None else min(num_blocks, most)


def kv_cache_manager(
    num_blocks: int, cache: CacheConfig, sched: SchedulerConfig
) -> KVCacheManager | HybridKVCacheManager:
    """The engine's manager of `num_blocks` blocks: a pair for a model with both kinds of
    layers (the runner sizes the sliding layers' caches with the same sliding_pool_blocks)."""
    if cache.hybrid_window is None:
        return KVCacheManager(
            num_blocks, cache.block_size, cache.enable_prefix_caching, cache.sliding_window
        )
    num_sliding = sliding_pool_blocks(
        num_blocks, cache.hybrid_window, cache.block_size, sched.max_num_seqs,
        sched.max_num_batched_tokens,
    )  # fmt: skip
    return HybridKVCacheManager(
        num_blocks, num_sliding, cache.block_size, cache.enable_prefix_caching,
        cache.hybrid_window,
    )  # fmt: skip


class HybridKVCacheManager:
    """Two KVCacheManagers, one per attention kind, behind the scheduler's interface."""

    def __init__(
        self,
        num_blocks: int,
        num_sliding_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        window: int,
    ) -> None:
        self.block_size = block_size
        self.full = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.sliding = KVCacheManager(
            num_sliding_blocks, block_size, enable_prefix_caching, sliding_window=window
        )
        # The scheduler's calls that one kind answers alone.
        self.get_block_ids = self.full.get_block_ids
        self.get_sliding_block_ids = self.sliding.get_block_ids
        self.take_pending_copies = self.full.take_pending_copies
        self.take_pending_sliding_copies = self.sliding.take_pending_copies

    def get_computed_blocks(self, request: Request) -> tuple[Hits, int]:
        """The longest cached prefix both kinds hold (see the module docstring)."""
        full_hits, _ = self.full.get_computed_blocks(request)
        num_hit, sliding_hits = self._window_hits(request, len(full_hits))
        return (full_hits[:num_hit], sliding_hits), num_hit * self.block_size

    def _window_hits(self, request: Request, max_blocks: int) -> tuple[int, list]:
        """The most leading blocks, up to `max_blocks`, whose last window the sliding pool
        holds, and the sliding table's front for them (None before the window)."""
        size, window, pool = self.block_size, self.sliding.sliding_window, self.sliding.pool
        found = [pool.get_cached_block(h) for h in request.block_hashes[:max_blocks]]
        run, best, best_first = 0, 0, 0  # run: cached blocks in a row, ending at block n - 1
        for n in range(1, max_blocks + 1):
            run = run + 1 if found[n - 1] is not None else 0
            first = max(n * size - window + 1, 0) // size  # the first block the next query sees
            if run >= n - first:
                best, best_first = n, first
        return best, [None] * best_first + found[best_first:best]

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Hits | None = None
    ) -> bool:
        """Both tables grow, or neither (KVCacheManager.allocate_slots)."""
        full_hits, sliding_hits = new_computed_blocks or (None, None)
        full_plan = self.full.plan(request, num_new_tokens, full_hits)
        sliding_plan = self.sliding.plan(request, num_new_tokens, sliding_hits)
        if full_plan is None or sliding_plan is None:
            return False
        request_id = request.request_id
        sliding_ids = self.sliding._block_ids.get(request_id)
        self.full.apply(request, full_hits, full_plan)
        self.sliding.apply(request, sliding_hits, sliding_plan)
        if sliding_ids is not None and self.sliding._block_ids[request_id] is not sliding_ids:
            # An entry changed: the full list is replaced too, as the scheduler watches it.
            self.full._block_ids[request_id] = list(self.full._block_ids[request_id])
        return True

    def free(self, request: Request) -> None:
        self.full.free(request)
        self.sliding.free(request)

    def fork(self, parent: Request, child: Request) -> None:
        self.full.fork(parent, child)
        self.sliding.fork(parent, child)

    def reset_prefix_cache(self) -> bool:
        full = self.full.reset_prefix_cache()
        return self.sliding.reset_prefix_cache() and full

    def free_block_ids(self) -> dict[bool, list[int]]:
        return {False: self.full.pool.free_block_ids(), True: self.sliding.pool.free_block_ids()}

    # ---- views: the full layers' pool is the one that runs out ----------------------------

    num_free_blocks = property(lambda self: self.full.num_free_blocks)
    num_total_blocks = property(lambda self: self.full.num_total_blocks)
    num_shared_block_refs = property(lambda self: self.full.num_shared_block_refs)
    prefix_cache_queries = property(lambda self: self.full.prefix_cache_queries)
    prefix_cache_hits = property(lambda self: self.full.prefix_cache_hits)
    sharing = property(lambda self: self.full.sharing)
    num_out_of_window = property(lambda self: self.sliding.num_out_of_window)
