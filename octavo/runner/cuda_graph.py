"""CUDA graphs for decode steps: capture a ladder of batch sizes, pad up, replay.

A decode step of a small model is hundreds of tiny kernels; launching them one by one from
Python costs more than running them. A captured graph replays them all in one launch, over
static buffers whose addresses never change: each step copies its inputs into the front of
those buffers and pads the rest with a scratch slot that no request owns.
"""

from __future__ import annotations

import torch

from octavo.attention.backend import AttentionMetadata
from octavo.runner.inputs import InputBuilder


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs (vLLM uses a similar ladder)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class CudaGraphRunner:
    """Captures `model(input_ids, positions, md)` for pure-decode batches.

    The graphs read the model runner's persistent input buffers (`InputBuilder`), which each
    step fills, padding rows included, before `replay`.

    Args:
        model: the model, with its KV caches bound.
        inputs: the persistent input buffers.
        max_num_seqs: the largest batch to capture.
    """

    def __init__(self, model: torch.nn.Module, inputs: InputBuilder, max_num_seqs: int) -> None:
        self.model = model
        self.inputs = inputs
        self.sizes = capture_sizes(max_num_seqs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _metadata(self, batch: int) -> AttentionMetadata:
        """Views of the buffers at a fixed shape: the full block-table width, so the decode
        kernel's grid is the same whatever the step's lengths."""
        buffers = self.inputs
        block_tables = buffers.block_tables[:batch]
        max_seq_len = block_tables.shape[1] * buffers.block_size
        return AttentionMetadata(
            num_tokens=batch,
            query_start_loc=buffers.query_start_loc[: batch + 1],
            seq_lens=buffers.seq_lens[:batch],
            slot_mapping=buffers.slot_mapping[:batch],
            block_tables=block_tables,
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_start_loc_cpu=list(range(batch + 1)),
            seq_lens_cpu=[max_seq_len] * batch,
            decode_order=buffers.decode_order[:batch],
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every size, largest first, sharing one memory pool. The buffers hold
        padding rows meanwhile (seq_len 1 in the scratch block)."""
        buffers = self.inputs
        largest = self.sizes[-1]
        buffers.slot_mapping[:largest].fill_(buffers.scratch_block * buffers.block_size)
        buffers.seq_lens[:largest].fill_(1)
        buffers.block_tables[:largest].fill_(buffers.scratch_block)
        buffers.query_start_loc[: largest + 1].copy_(torch.arange(largest + 1))
        buffers.decode_order[:largest].copy_(torch.arange(largest))
        for batch in reversed(self.sizes):
            md = self._metadata(batch)
            args = (buffers.input_ids[:batch], buffers.positions[:batch], md)
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
        """The smallest captured size >= batch, None if the batch is too large."""
        for size in self.sizes:
            if size >= batch:
                return size
        return None

    def replay(self, size: int) -> torch.Tensor:
        """Replays the graph of a captured size over the buffers. Returns [size, hidden]."""
        self.graphs[size].replay()
        return self.outputs[size]
