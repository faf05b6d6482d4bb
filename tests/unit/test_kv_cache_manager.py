"""KV cache manager: block tables, prefix hits and their cap, LRU reuse across requests,
all-or-nothing allocation, stats in tokens, fork; plus a random-operation invariant test."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from octavo.core.block_pool import hash_block_tokens
from octavo.core.kv_cache_manager import KVCacheManager
from octavo.core.request import Request
from octavo.sampling_params import SamplingParams


def make_request(rid: str, token_ids: list[int]) -> Request:
    return Request(rid, token_ids, SamplingParams())


def admit(kv: KVCacheManager, request: Request) -> tuple[list[int], int]:
    """Admits like the scheduler does and pretends the step ran. Returns (hit ids, hit tokens)."""
    hits, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, hits)
    request.num_computed_tokens = request.num_tokens
    return [b.block_id for b in hits], num_hit


def lookup(kv: KVCacheManager, request: Request) -> tuple[list[int], int]:
    hits, num_hit = kv.get_computed_blocks(request)
    return [b.block_id for b in hits], num_hit


def state(kv: KVCacheManager, *requests: Request):
    """Everything allocate_slots may change, to check that a refused call changed nothing."""
    pool = kv.pool
    tables = {r.request_id: kv._block_tables.get(r.request_id) for r in requests}
    return (
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        pool.free_block_ids(),
        dict(pool.cached_blocks),
        {rid: None if t is None else [b and b.block_id for b in t] for rid, t in tables.items()},
        [list(r.block_hashes) for r in requests],
    )


def test_block_table_covers_the_tokens_with_fresh_ids():
    kv = KVCacheManager(8, 4)
    a = make_request("a", list(range(10)))
    assert admit(kv, a) == ([], 0)
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.num_free_blocks == 5


def test_only_full_blocks_are_hashed():
    kv = KVCacheManager(8, 4)
    a = make_request("a", list(range(10)))
    admit(kv, a)
    h0 = hash_block_tokens(None, [0, 1, 2, 3])
    h1 = hash_block_tokens(h0, [4, 5, 6, 7])
    assert a.block_hashes == [h0, h1]
    assert [b.block_hash for b in kv._block_tables["a"]] == [h0, h1, None]


def test_decode_hashes_a_block_once_it_fills():
    kv = KVCacheManager(8, 4)
    a = make_request("a", list(range(7)))
    admit(kv, a)
    assert len(a.block_hashes) == 1
    a.append_output_token(7)  # 8 tokens: block 1 becomes full once this token is computed
    assert kv.allocate_slots(a, 1)
    a.num_computed_tokens = 8
    assert kv.get_block_ids("a") == [0, 1]
    assert kv.pool.blocks[1].block_hash == a.block_hashes[1]
    a.append_output_token(8)
    assert kv.allocate_slots(a, 1)
    assert kv.get_block_ids("a") == [0, 1, 2]


def test_slots_beyond_the_known_tokens_are_not_hashed():
    kv = KVCacheManager(8, 4)
    a = make_request("a", list(range(6)))
    assert kv.allocate_slots(a, 6 + 4)  # room for tokens not sampled yet
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert len(a.block_hashes) == 1
    assert [b.block_hash for b in kv.pool.blocks[:3]] == [a.block_hashes[0], None, None]


def test_prefix_hit_shares_blocks_and_counts_tokens():
    kv = KVCacheManager(8, 4)
    admit(kv, make_request("a", list(range(10))))
    b = make_request("b", list(range(8)) + [99, 98, 97])
    assert admit(kv, b) == ([0, 1], 8)
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert [blk.ref_cnt for blk in kv.pool.blocks[:4]] == [2, 2, 1, 1]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10 + 11, 8)


def test_a_request_for_prompt_logprobs_computes_its_whole_prompt_and_caches_it():
    """Until its prompt is scored it needs every prompt position's logits, so it takes no
    hits (as in vLLM), but its blocks are cached for the requests after it."""
    kv = KVCacheManager(8, 4)
    admit(kv, make_request("a", list(range(10))))
    wants = Request("b", list(range(10)), SamplingParams(prompt_logprobs=0))
    assert admit(kv, wants) == ([], 0)
    assert len(wants.block_hashes) == 2
    assert lookup(kv, make_request("c", list(range(10)))) == ([0, 1], 8)
    scored = Request("d", list(range(10)), SamplingParams(prompt_logprobs=0))
    scored.append_output_token(7)  # preempted after its first token: its prompt is scored
    assert lookup(kv, scored) == ([0, 1], 8)


def test_fully_cached_prompt_still_computes_its_last_token():
    kv = KVCacheManager(8, 16)
    a = make_request("a", list(range(32)))
    admit(kv, a)
    kv.free(a)
    b = make_request("b", list(range(32)))
    assert lookup(kv, b) == ([0], 16)
    # One more token and both blocks may hit.
    assert lookup(kv, make_request("c", list(range(33)))) == ([0, 1], 32)


def test_recomputed_duplicate_block_stays_uncached():
    kv = KVCacheManager(8, 4)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    kv.free(a)
    b = make_request("b", list(range(8)))
    assert admit(kv, b) == ([0], 4)
    # b recomputed block 1's tokens into a new block; block 1 keeps the hash.
    assert kv.get_block_ids("b") == [0, 2]
    assert kv.pool.get_cached_block(b.block_hashes[1]).block_id == 1
    assert kv.pool.blocks[2].block_hash is None


def test_hit_revives_cached_blocks_from_the_free_queue():
    kv = KVCacheManager(6, 4)
    a = make_request("a", list(range(12)))
    admit(kv, a)
    kv.free(a)
    assert kv.pool.free_block_ids() == [3, 4, 5, 2, 1, 0]
    b = make_request("b", list(range(9)))
    assert admit(kv, b) == ([0, 1], 8)
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert kv.pool.free_block_ids() == [4, 5, 2]


def test_lru_reuses_the_first_freed_request_tail_first():
    kv = KVCacheManager(6, 4)
    a = make_request("a", list(range(12)))
    b = make_request("b", list(range(100, 112)))
    admit(kv, a)
    admit(kv, b)
    kv.free(a)
    kv.free(b)
    assert kv.pool.free_block_ids() == [2, 1, 0, 5, 4, 3]
    admit(kv, make_request("c", list(range(200, 208))))
    assert kv.get_block_ids("c") == [2, 1]
    # a's first block survived, its second was evicted: the chain stops there.
    assert lookup(kv, make_request("a2", list(range(12)))) == ([0], 4)
    # b is untouched and still hits in full (up to the recomputed last token).
    assert lookup(kv, make_request("b2", list(range(100, 113)))) == ([3, 4, 5], 12)


def test_hash_hit_after_eviction_misses():
    kv = KVCacheManager(2, 4)
    a = make_request("a", list(range(5)))
    admit(kv, a)
    kv.free(a)
    admit(kv, make_request("x", list(range(50, 58))))  # takes both blocks
    assert lookup(kv, make_request("b", list(range(5)))) == ([], 0)


def test_allocate_slots_short_of_blocks_changes_nothing():
    # Pool of 3: a's two cached blocks are free, so 3 blocks look free, but b needs its 2
    # hits plus 2 new blocks and only 1 block is free apart from the hits.
    kv = KVCacheManager(3, 4)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    kv.free(a)
    b = make_request("b", list(range(13)))
    hits, num_hit = kv.get_computed_blocks(b)
    assert ([blk.block_id for blk in hits], num_hit) == ([0, 1], 8)
    before = state(kv, b)
    assert not kv.allocate_slots(b, b.num_tokens - num_hit, hits)
    assert state(kv, b) == before
    assert kv.num_free_blocks == 3
    assert "b" not in kv._block_tables


def test_allocate_slots_short_for_a_running_request_changes_nothing():
    kv = KVCacheManager(2, 4)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    a.append_output_token(8)
    before = state(kv, a)
    assert not kv.allocate_slots(a, 1)
    assert state(kv, a) == before


def test_a_lookup_counts_once_when_admitted_not_at_each_refusal():
    """A request at the head of the queue looks up the cache at every step until blocks
    are free; the stats count its tokens once, when it is admitted."""
    kv = KVCacheManager(4, 4)
    a = make_request("a", list(range(9)))
    admit(kv, a)  # 3 of 4 blocks
    b = make_request("b", list(range(8)) + [7, 7, 7, 7, 7, 7, 7, 7])  # 2 hits + 2 new blocks
    for _ in range(3):
        hits, num_hit = kv.get_computed_blocks(b)
        assert num_hit == 8 and not kv.allocate_slots(b, b.num_tokens - num_hit, hits)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (9, 0)
    kv.free(a)  # a finishes: its blocks stay cached, and free
    hits, num_hit = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, b.num_tokens - num_hit, hits)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (9 + 16, 8)


def test_prefix_caching_off_never_hits_or_counts():
    kv = KVCacheManager(8, 4, enable_prefix_caching=False)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    kv.free(a)
    b = make_request("b", list(range(9)))
    assert admit(kv, b) == ([], 0)
    assert a.block_hashes == [] and b.block_hashes == []
    assert dict(kv.pool.cached_blocks) == {}
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)


def test_free_unknown_request_is_a_noop_and_free_twice_too():
    kv = KVCacheManager(4, 4)
    a = make_request("a", list(range(5)))
    kv.free(a)
    admit(kv, a)
    kv.free(a)
    kv.free(a)
    assert kv.num_free_blocks == 4
    assert [b.ref_cnt for b in kv.pool.blocks] == [0, 0, 0, 0]


def test_preempted_request_hits_its_own_generated_tokens():
    kv = KVCacheManager(8, 4)
    a = make_request("a", list(range(6)))
    admit(kv, a)
    for t in (6, 7, 8):
        a.append_output_token(t)
        assert kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    kv.free(a)  # preemption by recompute
    a.num_computed_tokens = 0
    assert admit(kv, a) == ([0, 1], 8)
    assert kv.prefix_cache_hits == 8


def test_fork_shares_the_table_and_counts_references():
    kv = KVCacheManager(8, 4)
    parent = make_request("p", list(range(8)))
    admit(kv, parent)
    child = make_request("c", list(range(8)))
    child.num_computed_tokens = 8
    kv.fork(parent, child)
    assert kv.get_block_ids("c") == [0, 1]
    assert [b.ref_cnt for b in kv.pool.blocks[:2]] == [2, 2]
    child.append_output_token(50)
    assert kv.allocate_slots(child, 1)
    assert kv.get_block_ids("c") == [0, 1, 2]
    kv.free(parent)
    assert [b.ref_cnt for b in kv.pool.blocks[:3]] == [1, 1, 1]
    assert kv.num_free_blocks == 5
    kv.free(child)
    assert kv.num_free_blocks == 8


def test_reset_prefix_cache_forgets_unused_blocks():
    kv = KVCacheManager(8, 4)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert admit(kv, make_request("b", list(range(9)))) == ([], 0)
    assert kv.reset_prefix_cache() is False  # b's blocks are in use and stay cached


# ---- random operation sequences -----------------------------------------------------------

BS = 4
NUM_BLOCKS = 6
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 10, 11, 12, 13], [20, 21, 22, 23, 24]]


class KVCacheMachine(RuleBasedStateMachine):
    """Admits, grows, preempts, forks and frees requests on a small pool, simulating the KV
    writes of every step, and checks after each operation that the bookkeeping is exact and
    that every block holds the tokens its tables and its hash claim."""

    window: int | None = None  # every layer's sliding window (a subclass sets one)

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS, sliding_window=self.window)
        self.running: list[Request] = []
        self.waiting: list[Request] = []
        self.written: dict[int, list[int | None]] = {i: [None] * BS for i in range(NUM_BLOCKS)}
        self.num_requests = self.queries = self.hits = 0

    def _new_id(self) -> str:
        self.num_requests += 1
        return f"r{self.num_requests}"

    def _compute(self, request: Request) -> None:
        """Writes the request's uncomputed tokens into its blocks, as a model step would."""
        table = self.kv._block_tables[request.request_id]
        for pos in range(request.num_computed_tokens, request.num_tokens):
            block = table[pos // BS]
            assert block.ref_cnt == 1, f"writing into shared block {block.block_id}"
            self.written[block.block_id][pos % BS] = request.all_token_ids[pos]
        request.num_computed_tokens = request.num_tokens

    def _admit(self, request: Request) -> None:
        hits, num_hit = self.kv.get_computed_blocks(request)
        assert num_hit == len(hits) * BS < request.num_tokens
        for i, block in enumerate(hits):
            assert self.written[block.block_id] == request.all_token_ids[i * BS : (i + 1) * BS]
        before = state(self.kv, request, *self.running, *self.waiting)
        if self.kv.allocate_slots(request, request.num_tokens - num_hit, hits):
            self.queries += request.num_tokens  # a lookup counts once it is admitted
            self.hits += num_hit
            request.num_computed_tokens = num_hit
            self._compute(request)
            self.running.append(request)
        else:
            if self.window is None:  # with one, blocks out of the window went back anyway
                assert state(self.kv, request, *self.running, *self.waiting) == before
            self.waiting.append(request)

    @rule(
        prefix=st.sampled_from(PREFIXES),
        cut=st.integers(0, 9),
        suffix=st.lists(st.integers(0, 2), min_size=1, max_size=6),
    )
    def admit_new(self, prefix: list[int], cut: int, suffix: list[int]) -> None:
        self._admit(make_request(self._new_id(), prefix[:cut] + suffix))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def readmit(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.waiting))
        self.waiting.remove(request)
        self._admit(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), new_tokens=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def append(self, data: st.DataObject, new_tokens: list[int]) -> None:
        request = data.draw(st.sampled_from(self.running))
        for token in new_tokens:
            request.append_output_token(token)
        before = state(self.kv, *self.running)
        if self.kv.allocate_slots(request, request.num_tokens - request.num_computed_tokens):
            self._compute(request)
        else:
            if self.window is None:
                assert state(self.kv, *self.running) == before
            self.kv.free(request)  # preempt by recompute
            request.num_computed_tokens = 0
            self.running.remove(request)
            self.waiting.append(request)

    @precondition(lambda self: any(r.num_tokens % BS == 0 for r in self.running))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from([r for r in self.running if r.num_tokens % BS == 0]))
        child = make_request(self._new_id(), parent.all_token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv.fork(parent, child)
        self.running.append(child)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.running))
        table = self.kv._block_tables[request.request_id]
        self.kv.free(request)
        self.running.remove(request)
        unused = [b for b in table if b is not None and b.ref_cnt == 0]
        if unused:
            with pytest.raises(RuntimeError, match="double free"):
                self.kv.pool.free(unused[:1])
        self.kv.free(request)  # a second free of the request is a no-op

    @rule()
    def free_everything(self) -> None:
        for request in self.running:
            self.kv.free(request)
        self.running.clear()
        assert self.kv.num_free_blocks == NUM_BLOCKS
        assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks)

    @invariant()
    def bookkeeping_is_exact(self) -> None:
        pool = self.kv.pool
        tables = [self.kv._block_tables[r.request_id] for r in self.running]
        assert len(self.kv._block_tables) == len(self.running)
        holders = Counter(b.block_id for table in tables for b in table if b is not None)
        free_ids = set(pool.free_block_ids())
        for block in pool.blocks:
            assert block.ref_cnt == holders[block.block_id]
            assert (block.ref_cnt == 0) == (block.block_id in free_ids)
        in_use = sum(1 for b in pool.blocks if b.ref_cnt > 0)
        assert self.kv.num_free_blocks + in_use == NUM_BLOCKS
        kept = [[b for b in t if b is not None] for t in tables]
        assert all(len({b.block_id for b in t}) == len(t) for t in kept)
        assert self.kv.num_out_of_window == sum(t.count(None) for t in tables)
        for block_hash, block in pool.cached_blocks.items():
            assert block.block_hash == block_hash
        assert sum(b.block_hash is not None for b in pool.blocks) == len(pool.cached_blocks)
        assert (self.kv.prefix_cache_queries, self.kv.prefix_cache_hits) == (
            self.queries,
            self.hits,
        )

    @invariant()
    def blocks_hold_what_tables_and_hashes_claim(self) -> None:
        for request in self.running:
            table = self.kv._block_tables[request.request_id]
            tokens = request.all_token_ids
            assert len(table) == -(-request.num_tokens // BS)
            parent = None
            for i, block in enumerate(table):
                chunk = tokens[i * BS : (i + 1) * BS]
                if block is None:  # given back: wholly before the last query's window
                    assert (i + 1) * BS <= request.num_computed_tokens - self.window + 1
                    parent = hash_block_tokens(parent, chunk)
                    continue
                assert self.written[block.block_id][: len(chunk)] == chunk
                if len(chunk) == BS:
                    parent = hash_block_tokens(parent, chunk)
                    assert request.block_hashes[i] == parent
                    assert block.block_hash in (None, parent)
                else:
                    assert block.block_hash is None


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


class WindowedKVCacheMachine(KVCacheMachine):
    """The same operations with a sliding window of 6 on every layer."""

    window = 6


TestWindowedKVCacheMachine = WindowedKVCacheMachine.TestCase
TestWindowedKVCacheMachine.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None
)


# ---- a sliding window on every layer -------------------------------------------------------


def _decode(kv: KVCacheManager, request: Request, steps: int, held: list[int]) -> None:
    """Decodes `steps` tokens one at a time, noting the blocks the table holds each step."""
    for _ in range(steps):
        request.append_output_token(7)
        assert kv.allocate_slots(request, 1)
        request.num_computed_tokens += 1
        held.append(sum(b is not None for b in kv._block_tables[request.request_id]))


def test_a_request_of_eight_windows_holds_at_most_window_over_block_size_plus_two_blocks():
    window, size = 16, 4
    kv = KVCacheManager(64, size, sliding_window=window)
    a = make_request("a", list(range(10)))
    admit(kv, a)
    held: list[int] = []
    _decode(kv, a, 8 * window - 10, held)
    assert max(held) <= window // size + 2
    table = kv._block_tables["a"]
    assert kv.num_free_blocks == 64 - held[-1]
    assert kv.num_out_of_window == table.count(None) == len(table) - held[-1] > 0
    assert len(kv.get_block_ids("a")) == len(table)  # the runner keeps every id it was given
    kv.free(a)
    assert kv.num_free_blocks == 64 and kv.num_out_of_window == 0


def test_chunked_prefill_gives_back_blocks_each_chunk_and_keeps_its_window():
    window, size = 8, 4
    kv = KVCacheManager(16, size, sliding_window=window)
    a = make_request("a", list(range(100)))  # 25 blocks: more than the pool holds
    for start in range(0, 100, 10):
        assert kv.allocate_slots(a, min(10, 100 - start))
        a.num_computed_tokens += min(10, 100 - start)
    table = kv._block_tables["a"]
    first_seen = a.num_computed_tokens - window + 1
    kept = [i for i, b in enumerate(table) if b is not None]
    assert kept[0] <= first_seen // size and len(kept) <= window // size + 3


def test_blocks_out_of_the_window_stay_cached_for_a_later_prefix_hit():
    kv = KVCacheManager(32, 4, sliding_window=8)
    a = make_request("a", list(range(40)))
    admit(kv, a)
    _decode(kv, a, 4, [])
    assert kv._block_tables["a"][0] is None
    b = make_request("b", list(range(40)) + [99])
    ids, tokens = lookup(kv, b)
    assert tokens == 40 and ids[:2] == [0, 1]  # given back, still cached


def test_a_fork_shares_what_is_left_and_both_free_cleanly():
    kv = KVCacheManager(32, 4, sliding_window=8)
    a = make_request("a", list(range(30)))
    admit(kv, a)
    _decode(kv, a, 3, [])
    gone = kv.num_out_of_window
    child = make_request("a#1", list(a.all_token_ids))
    child.num_computed_tokens = a.num_computed_tokens
    kv.fork(a, child)
    assert kv.num_out_of_window == 2 * gone
    kv.free(a)
    kv.free(child)
    assert kv.num_free_blocks == 32 and kv.num_out_of_window == 0
