"""The model runner's step inputs (`octavo/runner/inputs.py`) on the CPU: flat positions and
slots, CUDA-graph padding, and the longest-first decode order the Triton kernel reads."""

from __future__ import annotations

import torch

from octavo.engine.scheduler import ScheduledRequest
from octavo.runner.inputs import InputBuilder

BLOCK = 4


def builder() -> InputBuilder:
    return InputBuilder(64, 8, 16, BLOCK, scratch_block=99, device=torch.device("cpu"))


def scheduled(request_id: str, tokens: list[int], computed: int, blocks: list[int]):
    return ScheduledRequest(request_id, tokens, computed, blocks, sample=True, request=None)


def test_decode_step_with_graph_padding_orders_longest_first():
    steps = [
        scheduled("a", [7], 5, [3, 8]),  # position 5, context 6
        scheduled("b", [9], 11, [1, 2, 4]),  # position 11, context 12
        scheduled("c", [4], 0, [6]),  # position 0, context 1
    ]
    step = builder().build(steps, 4, {}, None)
    md = step.md
    assert step.input_ids.tolist() == [7, 9, 4, 0]
    assert step.positions.tolist() == [5, 11, 0, 0]
    # slot = block_table[pos // 4] * 4 + pos % 4; the padding row writes the scratch block
    assert md.slot_mapping.tolist() == [8 * 4 + 1, 4 * 4 + 3, 6 * 4, 99 * 4]
    assert md.seq_lens.tolist() == [6, 12, 1, 1]
    assert md.block_tables[3, 0] == 99
    assert md.decode_order.tolist() == [1, 0, 2, 3]  # by context length, ties in row order
    assert sorted(md.decode_order.tolist()) == list(range(4))


def test_prefill_step_has_no_decode_order():
    steps = [scheduled("a", [7], 5, [3, 8]), scheduled("b", [1, 2, 3], 0, [5])]
    step = builder().build(steps, None, {}, None)
    md = step.md
    assert md.decode_order is None
    assert step.positions.tolist() == [5, 0, 1, 2]
    assert md.query_start_loc.tolist() == [0, 1, 4]
    assert md.slot_mapping.tolist() == [8 * 4 + 1, 20, 21, 22]
    assert md.seq_lens.tolist() == [6, 3]
