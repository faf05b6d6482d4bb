"""CUDA graphs: capture a ladder of step shapes, pad a step up to the nearest, replay.

A step of a small model is hundreds of tiny kernels; launching them one by one from Python
costs more than running them (see docs/PERFORMANCE.md). A captured graph replays them all in
one launch, over static buffers whose addresses never change: each step copies its inputs
into the front of those buffers and pads the rest.

Two ladders, each padded differently (runner/inputs.py):

    decode  B sequences of one token: B rows; padding rows are sequences of their own
            (seq_len 1 in the scratch block), through the fused decode kernel.
    mixed   T tokens of prompts, chunks and decode rows: T rows, S = min(T, max_num_seqs)
            sequences; padding tokens belong to no sequence and write the scratch block,
            padding sequences have no tokens. Up to `max_mixed_tokens` tokens.

Mixed steps can be whole graphs, attention included, because the prefill kernel sizes its
grid from T and S alone and reads every length from the device (kernels/prefill_attention.py):
a replay over other lengths runs the same grid, and surplus programs return at once.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from octavo.attention.backend import AttentionMetadata
from octavo.runner.inputs import GraphShape, InputBuilder

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Decode batches: 1, 2, 4, 8, then every 16 up to max_num_seqs (vLLM uses a similar
    ladder)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def mixed_capture_sizes(max_tokens: int) -> list[int]:
    """Mixed steps' token counts: every 16 up to 256, then every 32, up to max_tokens
    (itself included); none if max_tokens < 16."""
    sizes = list(range(16, min(max_tokens, 256) + 1, 16))
    sizes += list(range(288, max_tokens + 1, 32))
    if sizes and sizes[-1] != max_tokens:
        sizes.append(max_tokens)
    return sizes


class CudaGraphRunner:
    """Captures `model(input_ids, positions, md)` for decode steps and for small mixed steps.

    The graphs read the model runner's persistent input buffers (`InputBuilder`), which each
    step fills, padding included, before `replay`.

    Args:
        model: the model, with its KV caches bound.
        inputs: the persistent input buffers.
        max_num_seqs: the largest decode batch to capture, and the most sequences of a step.
        max_mixed_tokens: the largest mixed step to capture, in tokens (0: none).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        inputs: InputBuilder,
        max_num_seqs: int,
        max_mixed_tokens: int = 0,
    ) -> None:
        self.model = model
        self.inputs = inputs
        self.max_num_seqs = max_num_seqs
        self.decode_shapes = [GraphShape(b, b, True) for b in capture_sizes(max_num_seqs)]
        self.mixed_shapes = [
            GraphShape(t, min(t, max_num_seqs), False)
            for t in mixed_capture_sizes(max_mixed_tokens)
        ]
        self.graphs: dict[GraphShape, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphShape, torch.Tensor] = {}
        self.pool = None

    def _metadata(self, shape: GraphShape) -> AttentionMetadata:
        """Views of the buffers at the shape's fixed sizes, with the full block-table width,
        so a kernel's grid is the same whatever the step's lengths. A mixed shape's
        max_query_len only has to exceed 1: it picks the prefill path, which reads no host
        length but num_tokens and num_seqs."""
        buffers = self.inputs
        tokens, seqs = shape.num_tokens, shape.num_seqs
        block_tables = buffers.block_tables[:seqs]
        max_seq_len = block_tables.shape[1] * buffers.block_size
        md = AttentionMetadata(
            num_tokens=tokens,
            query_start_loc=buffers.query_start_loc[: seqs + 1],
            seq_lens=buffers.seq_lens[:seqs],
            slot_mapping=buffers.slot_mapping[:tokens],
            block_tables=block_tables,
            max_query_len=1 if shape.decode else tokens,
            query_start_loc_cpu=list(range(seqs + 1)) if shape.decode else [0] * (seqs + 1),
            seq_lens_cpu=[max_seq_len] * seqs,
            decode_order=buffers.decode_order[:seqs] if shape.decode else None,
        )
        if buffers.sliding_scratch is not None:  # the sliding layers' own (core/hybrid_kv.py)
            md.sliding = dataclasses.replace(
                md,
                slot_mapping=buffers.sliding_slot_mapping[:tokens],
                block_tables=buffers.sliding_block_tables[:seqs],
            )
        return md

    def shapes(self) -> list[GraphShape]:
        """Every shape to capture, largest first within each ladder (mixed ones first)."""
        return self.mixed_shapes[::-1] + self.decode_shapes[::-1]

    def _fill_padding(self, shape: GraphShape) -> None:
        """Puts the buffers in a padding-only state for capturing `shape`: every token writes
        the scratch block; decode rows are one-token sequences there, mixed sequences have
        no tokens (so the prefill kernel's programs return at once)."""
        buffers = self.inputs
        tokens, seqs = shape.num_tokens, shape.num_seqs
        buffers.input_ids[:tokens].zero_()
        buffers.positions[:tokens].zero_()
        buffers.slot_mapping[:tokens].fill_(buffers.scratch_block * buffers.block_size)
        buffers.seq_lens[:seqs].fill_(1)
        buffers.block_tables[:seqs].fill_(buffers.scratch_block)
        if buffers.sliding_scratch is not None:
            buffers.sliding_slot_mapping[:tokens].fill_(
                buffers.sliding_scratch * buffers.block_size
            )
            buffers.sliding_block_tables[:seqs].fill_(buffers.sliding_scratch)
        if shape.decode:
            buffers.query_start_loc[: seqs + 1].copy_(torch.arange(seqs + 1))
            buffers.decode_order[:seqs].copy_(torch.arange(seqs))
        else:
            buffers.query_start_loc[: seqs + 1].zero_()

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every shape, sharing one memory pool: an eager warm-up run, then the
        capture."""
        start = time.perf_counter()
        for shape in self.shapes():
            self._fill_padding(shape)
            md = self._metadata(shape)
            tokens = shape.num_tokens
            args = (self.inputs.input_ids[:tokens], self.inputs.positions[:tokens], md)
            self.model(*args)  # warm up: Triton compiles, cuBLAS loads, allocator settles
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[shape] = self.model(*args)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[shape] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured %d CUDA graphs (decode batches up to %d, mixed steps up to %d tokens) "
            "in %.1f s", len(self.graphs), self.decode_shapes[-1].num_seqs,
            self.mixed_shapes[-1].num_tokens if self.mixed_shapes else 0,
            time.perf_counter() - start,
        )  # fmt: skip

    def shape_for(self, num_tokens: int, num_seqs: int) -> GraphShape | None:
        """The smallest captured shape a step of `num_tokens` over `num_seqs` sequences pads
        up to, None if none fits (the step then runs eagerly)."""
        if num_seqs > self.max_num_seqs:
            return None
        ladder = self.decode_shapes if num_tokens == num_seqs else self.mixed_shapes
        return next((shape for shape in ladder if shape.num_tokens >= num_tokens), None)

    def replay(self, shape: GraphShape) -> torch.Tensor:
        """Replays the graph of a captured shape over the buffers. Returns [tokens, hidden]."""
        self.graphs[shape].replay()
        return self.outputs[shape]
