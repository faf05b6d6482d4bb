"""A step's flat input tensors: built on the host with numpy, uploaded without waiting.

    scheduled      a: decode, 1 token at 40     b: prefill chunk, 3 tokens at 0..2
    input_ids      [a40, b0, b1, b2]            positions  [40, 0, 1, 2]
    query_start_loc [0, 1, 4]                   seq_lens   [41, 3]
    slot_mapping[t] = block_table[seq][pos // block_size] * block_size + pos % block_size

The inputs land in persistent device buffers (CUDA graphs replay over them), each copied from
pinned host memory with non_blocking=True: a plain `torch.tensor(list, device="cuda")` waits
for the device to finish all queued work, which would put the host back in series with the
GPU. The caching host allocator keeps a pinned buffer alive until its copy has run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from octavo.attention.backend import AttentionMetadata
from octavo.core.sched_output import ScheduledRequest
from octavo.runner.host_copy import to_device


@dataclass(frozen=True)
class GraphShape:
    """A captured step shape (runner/cuda_graph.py): `num_tokens` rows over `num_seqs`
    sequences; `decode` if each sequence has one token (the decode ladder)."""

    num_tokens: int
    num_seqs: int
    decode: bool


class BlockTableRows:
    """Every running request's block table as a row of one numpy array, kept up to date
    from each step's changes (`ScheduledRequest.new_block_ids`); with `sliding`, the sliding
    layers' tables too, in the same rows of a second array (core/hybrid_kv.py)."""

    def __init__(self, max_blocks_per_seq: int, num_rows: int, sliding: bool = False) -> None:
        self.table = np.zeros((num_rows, max_blocks_per_seq), dtype=np.int32)
        self.sliding = np.zeros_like(self.table) if sliding else None
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self._rows: dict[str, int] = {}
        self._lengths: dict[str, int] = {}  # request id -> blocks in its table

    def row(
        self, request_id: str, start: int, new_block_ids: list[int], new_sliding: list[int]
    ) -> tuple[int, int]:
        """The request's row and table length, after writing `new_block_ids` (and the sliding
        layers' `new_sliding`) from `start`."""
        row = self._rows.get(request_id)
        if row is None:
            row = self._rows[request_id] = self._take_row()
        if new_block_ids:
            end = start + len(new_block_ids)
            if end > self.table.shape[1]:
                raise ValueError(f"{end} blocks exceed the block table's width")
            self.table[row, start:end] = new_block_ids
            if self.sliding is not None:
                assert len(new_sliding) == len(new_block_ids), "the two tables fell out of step"
                self.sliding[row, start:end] = new_sliding
            self._lengths[request_id] = end
        return row, self._lengths[request_id]

    def update(self, scheduled: list[ScheduledRequest]) -> tuple[list[int], int]:
        """Writes a step's table changes; returns its requests' rows and longest table."""
        row_of, rows, width = self.row, [], 0
        for s in scheduled:
            row, length = row_of(
                s.request_id, s.block_ids_start, s.new_block_ids, s.new_sliding_block_ids
            )
            rows.append(row)
            width = max(width, length)
        return rows, width

    def capacity(self, request_id: str) -> int:
        """Blocks in the request's table."""
        return self._lengths[request_id]

    def release(self, request_ids: list[str]) -> None:
        """Forgets finished or preempted requests (unknown ids are ignored)."""
        for request_id in request_ids:
            row = self._rows.pop(request_id, None)
            if row is not None:
                self._lengths.pop(request_id, None)
                self._free_rows.append(row)

    def _take_row(self) -> int:
        if not self._free_rows:  # more requests hold rows than expected: grow
            old = self.table.shape[0]
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            if self.sliding is not None:
                self.sliding = np.concatenate([self.sliding, np.zeros_like(self.sliding)])
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        return self._free_rows.pop()


@dataclass
class StepInputs:
    """The model's inputs for one step (device tensors, views of the persistent buffers)."""

    input_ids: torch.Tensor  # [T] int64 (T includes CUDA-graph padding rows)
    positions: torch.Tensor  # [T] int64
    md: AttentionMetadata


class InputBuilder:
    """Owns the persistent device input buffers and fills them for each step.

    Args:
        max_num_tokens: the most tokens a step computes (max_num_batched_tokens).
        max_num_seqs: the most sequences in a step (and the largest CUDA-graph batch).
        max_blocks_per_seq: the block-table width (max_model_len / block_size, rounded up).
        scratch_block: a KV block no request owns, for CUDA-graph padding rows.
        sliding_scratch: the same in the sliding layers' pool, for a model whose layers
            attend two ways (core/hybrid_kv.py): then each step's metadata carries the
            sliding layers' slots and tables as `md.sliding`. None for other models.
    """

    def __init__(
        self,
        max_num_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        scratch_block: int,
        device: torch.device,
        sliding_scratch: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.sliding_scratch = sliding_scratch
        self.device = device
        self.pin = device.type == "cuda"
        self.rows = BlockTableRows(max_blocks_per_seq, max_num_seqs, sliding_scratch is not None)
        t, b = max(max_num_tokens, max_num_seqs), max_num_seqs

        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = zeros(t, dtype=torch.int64)
        self.positions = zeros(t, dtype=torch.int64)
        self.slot_mapping = zeros(t, dtype=torch.int64)
        self.query_start_loc = zeros(b + 1, dtype=torch.int32)
        self.seq_lens = zeros(b, dtype=torch.int32)
        self.block_tables = zeros(b, max_blocks_per_seq, dtype=torch.int32)
        self.decode_order = zeros(b, dtype=torch.int32)
        if sliding_scratch is not None:
            self.sliding_slot_mapping = zeros(t, dtype=torch.int64)
            self.sliding_block_tables = zeros(b, max_blocks_per_seq, dtype=torch.int32)

    def build(
        self,
        scheduled: list[ScheduledRequest],
        graph: GraphShape | None,
        pending_rows: dict[str, int],
        last_sampled: torch.Tensor | None,
    ) -> StepInputs:
        """Fills the buffers for `scheduled` and returns views of them.

        Args:
            graph: for a step replayed as a CUDA graph, the captured shape it pads up to
                (see _pad); padding writes only the scratch block.
            pending_rows: request id -> its row in `last_sampled`, for requests whose last
                new token is still on the device (`input_is_pending`).
            last_sampled: the previous step's sampled token ids, on the device.
        """
        num_seqs = len(scheduled)
        rows, width = self.rows.update(scheduled)
        starts = np.fromiter((s.num_computed_tokens for s in scheduled), np.int64, num_seqs)
        q_lens = np.fromiter((s.num_new_tokens for s in scheduled), np.int64, num_seqs)
        cu = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        num_tokens = int(cu[-1])
        positions, ids = _positions_and_ids(scheduled, starts, q_lens, cu)
        seq_lens = starts + q_lens
        token_seq = np.repeat(np.arange(num_seqs), q_lens)
        tables, slots = self._slots(self.rows.table, rows, width, token_seq, positions)
        input_ids = np.array(ids, dtype=np.int64)
        if graph is not None and (graph.num_tokens, graph.num_seqs) != (num_tokens, num_seqs):
            input_ids, positions, seq_lens, cu = self._pad(
                graph, input_ids, positions, seq_lens, cu
            )
            slots, tables = self._pad_tables(graph, slots, tables, self.scratch_block)
        size = graph.num_seqs if graph is not None else num_seqs
        decode_order = None
        if num_tokens == num_seqs:  # longest first: see octavo/kernels/decode_attention.py
            order = np.argsort(-seq_lens, kind="stable").astype(np.int32)
            decode_order = self._upload(self.decode_order, order)
        cu_cpu = cu[: num_seqs + 1].tolist()
        md = AttentionMetadata(
            num_tokens=num_tokens,
            query_start_loc=self._upload(self.query_start_loc, cu.astype(np.int32)),
            seq_lens=self._upload(self.seq_lens, seq_lens.astype(np.int32)),
            slot_mapping=self._upload(self.slot_mapping, slots),
            block_tables=self._upload(self.block_tables, tables),
            max_query_len=int(q_lens.max()),
            query_start_loc_cpu=cu_cpu,
            seq_lens_cpu=seq_lens[:num_seqs].tolist(),
            decode_order=decode_order,
        )
        assert md.block_tables.shape[0] == size
        if self.rows.sliding is not None:
            md.sliding = self._sliding_metadata(md, graph, rows, width, token_seq, positions)
        input_ids_dev = self._upload(self.input_ids, input_ids)
        self._fill_pending(scheduled, cu_cpu, pending_rows, last_sampled)
        return StepInputs(input_ids_dev, self._upload(self.positions, positions), md)

    def _slots(self, table_rows, rows, width, token_seq, positions):
        """The step's rows of a block-table array, and each new token's cache slot."""
        tables = table_rows[rows, :width]  # [B, W]
        positions = positions[: len(token_seq)]
        block = tables[token_seq, positions // self.block_size].astype(np.int64)
        return tables, block * self.block_size + positions % self.block_size

    def _sliding_metadata(self, md, graph, rows, width, token_seq, positions):
        """`md` with the sliding layers' slots and tables (core/hybrid_kv.py)."""
        tables, slots = self._slots(self.rows.sliding, rows, width, token_seq, positions)
        if graph is not None and (graph.num_tokens, graph.num_seqs) != (len(slots), len(tables)):
            slots, tables = self._pad_tables(graph, slots, tables, self.sliding_scratch)
        return dataclasses.replace(
            md,
            slot_mapping=self._upload(self.sliding_slot_mapping, slots),
            block_tables=self._upload(self.sliding_block_tables, tables),
        )

    def _pad(self, graph, input_ids, positions, seq_lens, cu):
        """Pads a step up to a captured graph's shape. Padding tokens are id 0 at position 0,
        written to slot 0 of the scratch block (_pad_tables). In a decode graph each padding
        token is a sequence of its own (seq_len 1: it reads the slot it wrote). In a mixed
        graph padding tokens belong to no sequence (their outputs are garbage nobody reads)
        and padding sequences have no tokens, so every attention program skips them."""
        extra_tokens = graph.num_tokens - len(input_ids)
        extra_seqs = graph.num_seqs - len(seq_lens)
        if graph.decode:
            pad_lens, cu = np.ones(extra_seqs, np.int64), np.arange(graph.num_seqs + 1)
        else:
            pad_lens = np.zeros(extra_seqs, np.int64)
            cu = np.append(cu, np.full(extra_seqs, cu[-1]))
        return (
            np.concatenate([input_ids, np.zeros(extra_tokens, np.int64)]),
            np.concatenate([positions, np.zeros(extra_tokens, np.int64)]),
            np.concatenate([seq_lens, pad_lens]),
            cu,
        )

    def _pad_tables(self, graph, slots, tables, scratch: int):
        """Slots and tables padded to the graph's shape: padding tokens write slot 0 of the
        scratch block, and padding sequences' tables name only that block."""
        pad_tables = np.zeros((graph.num_seqs - tables.shape[0], tables.shape[1]), np.int32)
        pad_tables[:, 0] = scratch
        pad_slots = np.full(graph.num_tokens - len(slots), scratch * self.block_size)
        return np.concatenate([slots, pad_slots]), np.concatenate([tables, pad_tables])

    def _fill_pending(self, scheduled, cu, pending_rows, last_sampled) -> None:
        """Writes the tokens the previous step sampled, still on the device, into input_ids."""
        dst, src = [], []
        for s, end in zip(scheduled, cu[1:]):
            if s.input_is_pending:
                dst.append(end - 1 - len(s.spec_token_ids))
                src.append(pending_rows[s.request_id])
        if not dst:
            return
        assert last_sampled is not None, "a pending input without a previous step"
        self.copy_pending(to_device([dst, src], torch.int64, self.device), last_sampled)

    def copy_pending(self, index: torch.Tensor, last_sampled: torch.Tensor) -> None:
        """input_ids[index[0]] = last_sampled[index[1]], on the device (index: [2, P] int64)."""
        self.input_ids.index_copy_(0, index[0], last_sampled.index_select(0, index[1]))

    def _upload(self, buffer: torch.Tensor, array: np.ndarray) -> torch.Tensor:
        """Copies `array` into the front of `buffer` (rows and, for 2-D, columns); returns
        that view."""
        view = buffer[tuple(slice(0, n) for n in array.shape)]
        host = torch.from_numpy(np.ascontiguousarray(array))
        if self.pin:
            host = host.pin_memory()
        view.copy_(host, non_blocking=self.pin)
        return view


def _positions_and_ids(
    scheduled: list[ScheduledRequest], starts: np.ndarray, q_lens: np.ndarray, cu: np.ndarray
) -> tuple[np.ndarray, list[int]]:
    """Each new token's position and id, sequence after sequence, speculative guesses after
    the known tokens (a pending input's id is 0 here, filled on the device from the previous
    step's samples)."""
    num_tokens = int(cu[-1])
    if num_tokens == len(scheduled):  # all decode: one token each
        return starts, [s.token_ids[0] if s.token_ids else 0 for s in scheduled]
    positions = np.repeat(starts - cu[:-1], q_lens) + np.arange(num_tokens)
    ids: list[int] = []
    for s in scheduled:
        ids += s.token_ids
        if s.input_is_pending:
            ids.append(0)
        ids += s.spec_token_ids
    return positions, ids
