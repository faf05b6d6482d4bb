"""CUDA graphs for decode steps: capture a ladder of batch sizes, pad up, replay.

A decode step of a small model is hundreds of tiny kernels; launching them one by one from
Python costs more than running them. A captured graph replays them all in one launch, over
static buffers whose addresses never change: each step copies its inputs into the front of
those buffers and pads the rest with a scratch slot that no request owns.
"""

from __future__ import annotations

import torch

from octavo.attention.backend import AttentionMetadata


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs (vLLM uses a similar ladder)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class CudaGraphRunner:
    """Captures `model(input_ids, positions, md)` for pure-decode batches.

    Args:
        model: the model, with its KV caches bound.
        max_num_seqs: the largest batch to capture.
        max_blocks_per_seq: the block-table width (max_model_len / block_size, rounded up).
        block_size: tokens per block.
        scratch_block: a KV block no request owns; padded rows write there.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        scratch_block: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        self.max_blocks = max_blocks_per_seq
        n = max_num_seqs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), self.scratch_slot, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.full(
            (n, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=device
        )
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.sizes = capture_sizes(max_num_seqs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _metadata(self, batch: int) -> AttentionMetadata:
        max_seq_len = self.max_blocks * self.block_size
        return AttentionMetadata(
            num_tokens=batch,
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            slot_mapping=self.slot_mapping[:batch],
            block_tables=self.block_tables[:batch],
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_start_loc_cpu=list(range(batch + 1)),
            seq_lens_cpu=[max_seq_len] * batch,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every size, largest first, sharing one memory pool."""
        for batch in reversed(self.sizes):
            md = self._metadata(batch)
            args = (self.input_ids[:batch], self.positions[:batch], md)
            self.model(*args)  # warm up: Triton compiles, allocator settles
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[batch] = self.model(*args)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[batch] = graph
        torch.cuda.synchronize()

    def padded_size(self, batch: int) -> int | None:
        for size in self.sizes:
            if size >= batch:
                return size
        return None

    @torch.inference_mode()
    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """Replays the graph of the smallest captured size >= the batch. Returns [B, hidden]."""
        batch = md.num_seqs
        size = self.padded_size(batch)
        assert size is not None and md.max_query_len == 1
        width = md.block_tables.shape[1]
        self.input_ids[:batch].copy_(input_ids, non_blocking=True)
        self.positions[:batch].copy_(positions, non_blocking=True)
        self.slot_mapping[:batch].copy_(md.slot_mapping, non_blocking=True)
        self.seq_lens[:batch].copy_(md.seq_lens, non_blocking=True)
        self.block_tables[:batch, :width].copy_(md.block_tables, non_blocking=True)
        if size > batch:  # padded rows: one token each, written to the scratch slot
            self.slot_mapping[batch:size].fill_(self.scratch_slot)
            self.seq_lens[batch:size].fill_(1)
            self.block_tables[batch:size, 0].fill_(self.scratch_block)
        self.graphs[size].replay()
        return self.outputs[size][:batch]
