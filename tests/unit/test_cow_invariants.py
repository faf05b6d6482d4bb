"""Copy-on-write of shared KV blocks (n > 1, beam search) under random fork / append / step /
preempt / free sequences, with and without prefix caching.

A simulated KV store records the token written at every slot. Each step allocates slots for a
batch of sequences (a preemption may land between two allocations, as in the scheduler),
applies the queued block copies as the runner does (all at once, before any write), then
writes the step's tokens. (As in the scheduler, a request allocated this step is never freed
before the writes: its new full blocks are already in the prefix cache.) After every operation: each block's ref count equals the number of
tables holding it, free blocks are exactly the unreferenced ones, no write ever lands in a
shared block, and every sequence reads exactly its own tokens through its table.
"""

from __future__ import annotations

import itertools
from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from octavo.core.kv_cache_manager import KVCacheManager
from octavo.core.request import Request, RequestStatus
from octavo.sampling_params import SamplingParams

BS = 4
NUM_BLOCKS = 12
# Shared prompt prefixes, so prefix caching has something to hit.
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [20, 21, 22]]


class CopyOnWriteMachine(RuleBasedStateMachine):
    """Sequences are `running` (they hold a block table covering their computed tokens and
    may have appended tokens still to compute) or `waiting` (no blocks, nothing computed)."""

    enable_prefix_caching = False

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS, self.enable_prefix_caching)
        self.store: dict[int, list[int | None]] = {i: [None] * BS for i in range(NUM_BLOCKS)}
        self.running: list[Request] = []
        self.waiting: list[Request] = []
        self.ids = itertools.count()
        # Every generated token is unique, so reading another sequence's token is visible.
        self.fresh_tokens = itertools.count(1000)
        self.num_copies = 0
        self.seen_ids: dict[str, tuple[list[int], list[int]]] = {}

    # ---- operations -------------------------------------------------------------------

    @rule(prompt=st.sampled_from(PROMPTS), extra=st.integers(0, 3))
    def add(self, prompt: list[int], extra: int) -> None:
        tokens = prompt + [next(self.fresh_tokens) for _ in range(extra)]
        self.waiting.append(Request(f"r{next(self.ids)}", tokens, SamplingParams()))

    @precondition(lambda self: self.running or self.waiting)
    @rule(data=st.data(), count=st.integers(1, 6))
    def append(self, data: st.DataObject, count: int) -> None:
        request = data.draw(st.sampled_from(self.running + self.waiting))
        for _ in range(count):
            request.append_output_token(next(self.fresh_tokens))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), num_children=st.integers(1, 3), extend=st.booleans())
    def fork(self, data: st.DataObject, num_children: int, extend: bool) -> None:
        """As Scheduler.fork_request: children copy the tokens and share every block. With
        `extend`, parent and children each get a different next token (beam search)."""
        parent = data.draw(st.sampled_from(self.running))
        for _ in range(num_children):
            child = Request(f"r{next(self.ids)}", parent.prompt_token_ids, SamplingParams())
            for token in parent.output_token_ids:
                child.append_output_token(token)
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = RequestStatus.RUNNING
            self.kv.fork(parent, child)
            self.running.append(child)
            if extend:
                child.append_output_token(next(self.fresh_tokens))
        if extend:
            parent.append_output_token(next(self.fresh_tokens))

    @precondition(lambda self: self.running or self.waiting)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """Allocates for a random batch (admitting waiting ones, preempting on failure or at
        random in between), applies the copies, then writes the batch's tokens."""
        batch = data.draw(st.permutations(self.running + self.waiting))
        batch = batch[: data.draw(st.integers(1, len(batch)))]
        scheduled: list[Request] = []
        for request in batch:
            if request in self.waiting:
                if self._admit(request):
                    scheduled.append(request)
            elif self.kv.allocate_slots(request, request.num_tokens - request.num_computed_tokens):
                scheduled.append(request)
            else:
                self._preempt(request)
            # A victim, as the scheduler picks them: running, not yet scheduled this step.
            victims = [r for r in self.running if r not in scheduled]
            if victims and data.draw(st.integers(0, 3)) == 0:
                self._preempt(data.draw(st.sampled_from(victims)))
        self._apply_copies()
        for request in scheduled:
            self._write(request)

    @precondition(lambda self: self.running or self.waiting)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.running + self.waiting))
        self.kv.free(request)
        self.kv.free(request)  # a second free of a request is a no-op, not a double free
        (self.running if request in self.running else self.waiting).remove(request)

    # ---- the step's pieces ------------------------------------------------------------

    def _admit(self, request: Request) -> bool:
        hits, num_hit = self.kv.get_computed_blocks(request)
        if not self.kv.allocate_slots(request, request.num_tokens - num_hit, hits):
            return False
        request.num_computed_tokens = num_hit
        request.status = RequestStatus.RUNNING
        self.waiting.remove(request)
        self.running.append(request)
        return True

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.running.remove(request)
        self.waiting.append(request)

    def _apply_copies(self) -> None:
        copies = self.kv.take_pending_copies()
        # Like the runner's `cache[:, dst] = cache[:, src]`: read every source, then write.
        contents = [list(self.store[src]) for src, _ in copies]
        for (src, dst), content in zip(copies, contents, strict=True):
            assert src != dst
            self.store[dst] = content
        self.num_copies += len(copies)

    def _write(self, request: Request) -> None:
        """Writes the request's uncomputed tokens. A block may be shared while written only
        if every other holder has the same token there (a prefix hit on a block registered
        this step); a holder without a token there yet would later overwrite ours."""
        table = self.kv._block_tables[request.request_id]
        for pos in range(request.num_computed_tokens, request.num_tokens):
            block = table[pos // BS]
            token = request.all_token_ids[pos]
            for other in self.running:
                if other is request or pos // BS >= len(other_table := self._table(other)):
                    continue
                if other_table[pos // BS] is block:
                    theirs = other.all_token_ids[pos] if pos < other.num_tokens else None
                    assert theirs == token, f"{request} writes into {other}'s block {block}"
            self.store[block.block_id][pos % BS] = token
        request.num_computed_tokens = request.num_tokens

    def _table(self, request: Request) -> list:
        return self.kv._block_tables[request.request_id]

    # ---- invariants -------------------------------------------------------------------

    @invariant()
    def ref_counts_match_the_tables(self) -> None:
        tables = {r.request_id: self.kv.get_block_ids(r.request_id) for r in self.running}
        assert set(self.kv._block_tables) == set(tables), "a waiting request holds blocks"
        holders = Counter(block_id for table in tables.values() for block_id in table)
        for block in self.kv.pool.blocks:
            assert block.ref_cnt == holders[block.block_id], f"block {block.block_id}"
        assert self.kv.num_free_blocks == NUM_BLOCKS - len(holders)
        assert set(self.kv.pool.free_block_ids()) == set(range(NUM_BLOCKS)) - set(holders)
        assert self.kv.num_shared_block_refs == sum(n - 1 for n in holders.values())
        assert self.kv.sharing.num_cow_copies == self.num_copies
        assert not self.kv.pending_copies
        assert self.kv.sharing.peak_blocks_used >= len(holders)

    @invariant()
    def block_id_lists_mirror_the_tables(self) -> None:
        """The runner caches block-id lists by identity: a list may only grow in place, and
        one whose entries changed must be a new object."""
        for request in self.running:
            ids = self.kv.get_block_ids(request.request_id)
            assert ids == [block.block_id for block in self._table(request)]
            seen = self.seen_ids.get(request.request_id)
            if seen is not None and ids is seen[0]:
                assert ids[: len(seen[1])] == seen[1], "an entry changed in place"
            self.seen_ids[request.request_id] = (ids, list(ids))

    @invariant()
    def every_sequence_reads_exactly_its_own_tokens(self) -> None:
        for request in self.running:
            table = self.kv.get_block_ids(request.request_id)
            assert len(table) == -(-request.num_computed_tokens // BS), "a leaked block"
            for pos in range(request.num_computed_tokens):
                seen = self.store[table[pos // BS]][pos % BS]
                assert seen == request.all_token_ids[pos], f"{request} position {pos}"

    def teardown(self) -> None:
        for request in self.running + self.waiting:
            self.kv.free(request)
        assert self.kv.num_free_blocks == NUM_BLOCKS
        assert all(block.ref_cnt == 0 for block in self.kv.pool.blocks)


class CopyOnWriteWithPrefixCachingMachine(CopyOnWriteMachine):
    enable_prefix_caching = True


_settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestCopyOnWrite = CopyOnWriteMachine.TestCase
TestCopyOnWrite.settings = _settings
TestCopyOnWriteWithPrefixCaching = CopyOnWriteWithPrefixCachingMachine.TestCase
TestCopyOnWriteWithPrefixCaching.settings = _settings
