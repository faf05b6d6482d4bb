"""The block pool: every KV cache block, its ref count, the LRU free queue and the prefix cache.

Plain Python, no torch. The pool knows nothing about requests; `KVCacheManager` owns the
per-request block tables and calls in here.

    free queue (ref_cnt == 0), front evicted first      hash -> block (full blocks only)
    front [4, 5, 2, 0] back                              {h(0..15): block 0, h(16..31): block 2}

A block with ref_cnt 0 whose hash is still mapped is "cached but unused": it sits in the free
queue and counts as free, yet a prefix hit can revive it (`touch`) until `allocate` reuses it.
"""

from __future__ import annotations

from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import xxhash


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hashes one full block's (non-negative) token ids, chained to `parent_hash`, the hash
    of the block before it (None for the first block). A 64-bit xxh3 hash of a fixed byte
    encoding, the same in every process (Python's `hash()` is salted per process and would
    break sharing across workers or runs)."""
    # NOTE: the leading flag keeps "no parent" apart from a parent whose hash happens to be 0.
    head = [0] if parent_hash is None else [1, parent_hash]
    return xxhash.xxh3_64_intdigest(array("Q", head + list(token_ids)).tobytes())


@dataclass(slots=True, eq=False)
class KVBlock:
    """One physical block of the KV cache.

    `block_hash` is set only while the pool's hash map points at this block, so a block
    carries a hash if and only if a prefix lookup can find it.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


class BlockPool:
    """Owns all blocks, their ref counts, the LRU free queue and the hash -> block map.

    NOTE: invariants kept by every method: a block is in the free queue iff its ref_cnt is 0;
    `block.block_hash == h` iff the hash map maps `h` to that block.
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # An OrderedDict is a doubly linked list keyed by block id: O(1) pop from the front,
        # append at the back, and removal from the middle when a prefix hit revives a block.
        self._free_queue: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self._cached: dict[int, KVBlock] = {}
        self._num_refs = 0  # the sum of every block's ref_cnt, kept as they change

    # ---- allocation ---------------------------------------------------------------------

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Takes `num_blocks` blocks from the front of the free queue, each with ref_cnt 1.

        A taken block that was still cached loses its hash: its contents are about to be
        overwritten. Raises RuntimeError if fewer blocks are free (callers check first).
        """
        if num_blocks > len(self._free_queue):
            raise RuntimeError(f"allocating {num_blocks} blocks, only {self.num_free_blocks} free")
        taken = []
        for _ in range(num_blocks):
            _, block = self._free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        self._num_refs += num_blocks
        return taken

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drops one reference to each block; blocks reaching 0 go to the back of the free
        queue in the order given, so the first given is evicted first, except those that
        hold no cached prefix: they go to the front, to be taken again before any cached
        block is evicted or a block never used is touched (whose memory, on the CPU, the
        operating system maps only then).

        Raises RuntimeError, changing nothing, if a block would drop below 0 (double free).
        """
        blocks = list(blocks)
        for block, count in Counter(blocks).items():
            if block.ref_cnt < count:
                raise RuntimeError(
                    f"double free of block {block.block_id} (ref_cnt {block.ref_cnt})"
                )
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_queue[block.block_id] = block
                if block.block_hash is None:
                    self._free_queue.move_to_end(block.block_id, last=False)
        self._num_refs -= len(blocks)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Adds one reference to each block (prefix hits), taking unused ones out of the
        free queue so they cannot be evicted while in use."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_queue[block.block_id]
            block.ref_cnt += 1
            self._num_refs += 1

    def incref(self, blocks: Iterable[KVBlock]) -> None:
        """Adds one reference to blocks already in use (sharing between sequences: n > 1,
        beam search)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"incref of free block {block.block_id}"
            block.ref_cnt += 1
            self._num_refs += 1

    # ---- prefix cache -------------------------------------------------------------------

    def get_cached_block(self, block_hash: int) -> KVBlock | None:
        return self._cached.get(block_hash)

    def cache_block(self, block: KVBlock, block_hash: int) -> None:
        """Registers a full, in-use block under its hash.

        If another block already holds this hash, that mapping stays and `block` stays
        uncached (it is a duplicate and will simply be evicted when freed).
        """
        if not self.enable_prefix_caching or block.block_hash == block_hash:
            return
        assert block.ref_cnt > 0, f"caching free block {block.block_id}"
        assert block.block_hash is None, f"block {block.block_id} already has another hash"
        if block_hash in self._cached:
            return
        self._cached[block_hash] = block
        block.block_hash = block_hash

    def reset_prefix_cache(self) -> bool:
        """Forgets the hashes of all unused blocks. Returns True if the prefix cache is now
        empty, False if blocks in use still hold hashes (they stay findable)."""
        for block in self._free_queue.values():
            self._evict(block)
        return not self._cached

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None

    # ---- views --------------------------------------------------------------------------

    # Blocks with ref_cnt 0, cached-but-unused ones included (they are evictable).
    num_free_blocks = property(lambda self: len(self._free_queue))
    num_total_blocks = property(lambda self: len(self.blocks))

    @property
    def num_shared_refs(self) -> int:
        """References beyond each block's first (blocks saved by sharing), in O(1): every
        reference, less one per block in use."""
        return self._num_refs - (self.num_total_blocks - self.num_free_blocks)

    # Fraction of blocks in use, 0.0 to 1.0.
    usage = property(lambda self: 1.0 - self.num_free_blocks / self.num_total_blocks)

    @property
    def cached_blocks(self) -> Mapping[int, KVBlock]:
        """Read-only view of the hash -> block map."""
        return MappingProxyType(self._cached)

    def free_block_ids(self) -> list[int]:
        """The free queue's block ids, front (next to be allocated) first."""
        return list(self._free_queue)
