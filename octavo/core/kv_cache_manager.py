"""The KV cache manager: per-request block tables on top of the block pool, and prefix caching.

Plain Python, no torch. A request's block table lists the physical blocks that hold its
tokens, in order:

    block_table[req] = [7, 2, 9]      block_size = 4
    token 9 of req -> block 9 // 4 = 2 -> physical 9 -> slot 9*4 + 9 % 4 = 37

Only full blocks are hashed, each chained to the one before it (`hash_block_tokens`), so a
hash names a whole prefix; a lookup walks the chain and stops at the first miss.

With a sliding window on every layer (`sliding_window`), a block that no query can see any
more goes back to the pool as the request advances: the next query sits at
`num_computed_tokens` and sees from `num_computed_tokens - window + 1` on. Its entry in the
table becomes None; the runner keeps the old id, which no kernel reads unmasked.

    window 8, block_size 4, 13 computed:  [None, None, 9, 4]   (positions 0-7 unseen)
"""

from __future__ import annotations

from dataclasses import dataclass

from octavo.core.block_pool import BlockPool, KVBlock, hash_block_tokens
from octavo.core.request import Request


@dataclass
class SharingStats:
    """Block sharing between sequences of one prompt (n > 1, beam search)."""

    num_cow_copies: int = 0  # shared partial blocks copied before a write
    peak_blocks_used: int = 0


_IN_PLACE = object()  # allocate_slots has nothing to do: the table holds the new tokens


class KVCacheManager:
    """Gives requests blocks (reusing cached prefixes) and takes them back."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.num_out_of_window = 0  # table entries given back: blocks the window saves now
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        # Prefix cache counters, in tokens: looked up at admission, and found in the cache.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.sharing = SharingStats()
        # (source, destination) block ids the runner must copy before this step's writes.
        self.pending_copies: list[tuple[int, int]] = []
        self._block_tables: dict[str, list[KVBlock | None]] = {}
        # The same tables as block ids, for the runner. NOTE: a list here only grows in
        # place; when an entry changes (copy-on-write, a new table after preemption, a fork)
        # it is replaced by a new list, so a reader may cache what it saw by identity.
        self._block_ids: dict[str, list[int]] = {}
        # How many leading blocks of each table have been offered to the hash map already.
        self._num_cached_blocks: dict[str, int] = {}

    # ---- admission ----------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Finds the longest cached prefix of a request that is not admitted yet.

        Fills `request.block_hashes` for every full block of `all_token_ids`. Does not take
        references, nor count the lookup (a request that waits for blocks looks up again each
        step): pass the blocks to `allocate_slots`, which counts it once admitted.

        Returns:
            (hit blocks in order, number of hit tokens); ([], 0) with prefix caching off,
            and for a request that wants prompt log-probs and has no output yet, which needs
            every prompt position's logits (as in vLLM; its blocks are still cached for
            others). Once it has an output its prompt is scored, so a preempted one hits.
        """
        assert request.num_computed_tokens == 0, f"{request} is already admitted"
        if not self.enable_prefix_caching:
            return [], 0
        self._hash_full_blocks(request, request.num_tokens // self.block_size)
        if not self._looks_up(request):
            return [], 0
        # NOTE: the last token is always recomputed, even when the whole prompt is cached:
        # the model needs it as input to produce the next token's logits.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def _looks_up(self, request: Request) -> bool:
        """Whether admission reads the prefix cache for this request."""
        return self.enable_prefix_caching and (
            request.sampling_params.prompt_logprobs is None or bool(request.output_token_ids)
        )

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
    ) -> bool:
        """Grows the request's block table to hold its computed tokens, the prefix hits and
        `num_new_tokens` more.

        Args:
            request: the request; `num_computed_tokens` excludes `new_computed_blocks`.
            num_new_tokens: tokens to be computed this step.
            new_computed_blocks: prefix hits from `get_computed_blocks` (admission only,
                [] for none), referenced as the table's front; the lookup is counted.
        Returns:
            True on success; False, if too few blocks are free, changing nothing but the
            blocks before the window given back (they are free to use either way).
        """
        plan = self.plan(request, num_new_tokens, new_computed_blocks)
        if plan is None:
            return False
        self.apply(request, new_computed_blocks, plan)
        return True

    def apply(
        self, request: Request, new_computed_blocks: list[KVBlock | None] | None, plan
    ) -> None:
        """Carries out a `plan` made for these arguments (allocate_slots' second half)."""
        if plan is _IN_PLACE:
            return
        num_total_tokens, num_new_blocks, cow_index = plan
        request_id = request.request_id
        table = self._block_tables.get(request_id)
        if table is None:
            hits = new_computed_blocks or []
            if new_computed_blocks is not None and self._looks_up(request):
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += len(hits) * self.block_size
            self.pool.touch(block for block in hits if block is not None)
            table = self._block_tables[request_id] = list(hits)
            # A hit's entries before the window are None: id 0 stands in, read only masked.
            self._block_ids[request_id] = [0 if b is None else b.block_id for b in hits]
            self._num_cached_blocks[request_id] = len(hits)
            self.num_out_of_window += hits.count(None)
        if cow_index is not None:
            self._copy_on_write(request_id, table, cow_index)
        new_blocks = self.pool.allocate(num_new_blocks)
        table.extend(new_blocks)
        self._block_ids[request_id].extend(block.block_id for block in new_blocks)
        used = self.pool.num_total_blocks - self.pool.num_free_blocks
        self.sharing.peak_blocks_used = max(self.sharing.peak_blocks_used, used)
        if self.enable_prefix_caching:
            # NOTE: blocks are registered before this step writes their KV. A request admitted
            # later in the same step may hit them; that is safe because each attention layer
            # writes all of the step's KV before any token attends to it.
            num_full = min(num_total_tokens, request.num_tokens) // self.block_size
            self._cache_full_blocks(request, table, num_full)

    def plan(
        self, request: Request, num_new_tokens: int, hits: list[KVBlock | None] | None
    ) -> tuple[int, int, int | None] | object | None:
        """What allocate_slots must do: _IN_PLACE (nothing), None (too few blocks are free),
        or (tokens the table will hold, blocks to take, index of a block to copy or None).
        Changes nothing but the blocks before the window given back (free either way)."""
        assert num_new_tokens >= 0, f"num_new_tokens={num_new_tokens}"
        self._release_out_of_window(request)
        if not hits and self._fits_in_place(request, num_new_tokens):
            return _IN_PLACE
        hits = hits or []
        table = self._block_tables.get(request.request_id, [])
        assert not (hits and table), f"{request} got prefix hits after admission"
        num_total_tokens = (
            request.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        )
        num_new_blocks = max(-(-num_total_tokens // self.block_size) - len(table) - len(hits), 0)
        cow_index = self._shared_write_block(request, table, num_new_tokens)
        # NOTE: unused hit blocks sit in the free queue; touching them takes them out, so they
        # cannot also serve as new blocks.
        num_free_hits = sum(1 for block in hits if block is not None and block.ref_cnt == 0)
        num_cow = 0 if cow_index is None else 1
        if num_new_blocks + num_cow > self.pool.num_free_blocks - num_free_hits:
            return None
        return num_total_tokens, num_new_blocks, cow_index

    def _release_out_of_window(self, request: Request) -> None:
        """Gives back the blocks before the window of the request's next query."""
        table = self._block_tables.get(request.request_id)
        if self.sliding_window is None or not table:
            return
        first_seen = max(request.num_computed_tokens - self.sliding_window + 1, 0)
        unseen = min(first_seen // self.block_size, len(table))
        if unseen == 0 or table[unseen - 1] is None:  # given back already: a None prefix
            return
        start = unseen - 1
        while start > 0 and table[start - 1] is not None:  # only the newly unseen blocks
            start -= 1
        gone = table[start:unseen]
        table[start:unseen] = [None] * len(gone)
        self.num_out_of_window += len(gone)
        self.pool.free(reversed(gone))

    def _fits_in_place(self, request: Request, num_new_tokens: int) -> bool:
        """The common decode case, decided cheaply: the request's table already has room
        for the new tokens, the block written first is its own, and no block fills up
        (so there is nothing to hash). Then allocate_slots has nothing to do."""
        table = self._block_tables.get(request.request_id)
        if table is None:
            return False
        computed = request.num_computed_tokens
        total = computed + num_new_tokens
        size = self.block_size
        if total > len(table) * size or (num_new_tokens and table[computed // size].ref_cnt > 1):
            return False
        if not self.enable_prefix_caching:
            return True
        num_full = min(total, request.num_tokens) // size
        return num_full <= self._num_cached_blocks[request.request_id]

    def _shared_write_block(
        self, request: Request, table: list[KVBlock], num_new_tokens: int
    ) -> int | None:
        """Index of the block this step writes first, if another sequence shares it."""
        index = request.num_computed_tokens // self.block_size
        shared = num_new_tokens and index < len(table) and table[index].ref_cnt > 1
        return index if shared else None

    def _copy_on_write(self, request_id: str, table: list[KVBlock], index: int) -> None:
        """Gives this table a private copy of a shared partial block.

        NOTE: only a partial block can be shared and written: full blocks hold only computed
        tokens, and writes start at `num_computed_tokens`. The copy of its KV is queued in
        `pending_copies`, which the runner performs before the step's forward pass.
        """
        shared = table[index]
        (private,) = self.pool.allocate(1)
        self.pool.free([shared])
        table[index] = private
        block_ids = list(self._block_ids[request_id])  # a new list: an entry changes
        block_ids[index] = private.block_id
        self._block_ids[request_id] = block_ids
        self.pending_copies.append((shared.block_id, private.block_id))
        self.sharing.num_cow_copies += 1

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def free(self, request: Request) -> None:
        """Releases a request's blocks (finished, aborted or preempted). Unknown requests
        (never admitted) are ignored.

        NOTE: the blocks are freed tail first, so the tail, least likely to be shared by
        another prompt, is evicted before the prefix it extends.
        """
        table = self._block_tables.pop(request.request_id, None)
        self._block_ids.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if table is not None:
            self.num_out_of_window -= table.count(None)
            self.pool.free(block for block in reversed(table) if block is not None)

    def fork(self, parent: Request, child: Request) -> None:
        """Gives `child` the parent's block table, sharing every block (n > 1, beam search).
        The child's tokens must start with the parent's; it inherits their block hashes.

        NOTE: a shared partial last block is copied when a sequence first writes into it
        while it is still shared (copy-on-write, in `allocate_slots`).
        """
        assert child.request_id not in self._block_tables, f"{child} already has blocks"
        table = self._block_tables[parent.request_id]
        num_cached = self._num_cached_blocks[parent.request_id]
        self.pool.incref([block for block in table if block is not None])
        self.num_out_of_window += table.count(None)
        self._block_tables[child.request_id] = list(table)
        self._block_ids[child.request_id] = list(self._block_ids[parent.request_id])
        self._num_cached_blocks[child.request_id] = num_cached
        child.block_hashes = parent.block_hashes[:num_cached]

    # ---- hashing ------------------------------------------------------------------------

    def _hash_full_blocks(self, request: Request, num_blocks: int) -> None:
        """Extends `request.block_hashes` to cover its first `num_blocks` full blocks.

        NOTE: hashes survive preemption: `all_token_ids` only grows, so they stay valid.
        """
        hashes, size = request.block_hashes, self.block_size
        for i in range(len(hashes), num_blocks):
            parent = hashes[-1] if hashes else None
            hashes.append(
                hash_block_tokens(parent, request.all_token_ids[i * size : (i + 1) * size])
            )

    def _cache_full_blocks(self, request: Request, table: list[KVBlock], num_full: int) -> None:
        start = self._num_cached_blocks[request.request_id]
        if num_full <= start:
            return
        self._hash_full_blocks(request, num_full)
        for i in range(start, num_full):
            if table[i] is not None:
                self.pool.cache_block(table[i], request.block_hashes[i])
        self._num_cached_blocks[request.request_id] = num_full

    # ---- views --------------------------------------------------------------------------

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as physical block ids.

        NOTE: the manager's own list, not a copy: read it, never change it. It grows in
        place as blocks are added and is replaced by a new list when an entry changes.
        """
        return self._block_ids[request_id]

    def get_sliding_block_ids(self, request_id: str) -> list[int] | None:
        """The sliding layers' table where it is not this one (core/hybrid_kv.py): None."""
        return None

    def take_pending_sliding_copies(self) -> list[tuple[int, int]]:
        return []

    def reset_prefix_cache(self) -> bool:
        """Forgets all cached blocks not in use; True if the prefix cache is now empty."""
        return self.pool.reset_prefix_cache()

    def free_block_ids(self) -> dict[bool, list[int]]:
        """The free blocks of each pool: this one's under False (the full layers' pool)."""
        return {False: self.pool.free_block_ids(), True: []}

    num_free_blocks = property(lambda self: self.pool.num_free_blocks)
    num_total_blocks = property(lambda self: self.pool.num_total_blocks)
    # Blocks saved by sharing right now: every reference beyond a block's first.
    num_shared_block_refs = property(lambda self: self.pool.num_shared_refs)
