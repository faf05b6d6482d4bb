"""The model runner's step inputs (`octavo/runner/inputs.py`) on the CPU: flat positions and
slots, CUDA-graph padding (decode and mixed steps), the longest-first decode order the Triton
kernel reads, and which captured graph shape a step pads up to."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from octavo.core.sched_output import ScheduledRequest
from octavo.runner.cuda_graph import CudaGraphRunner, GraphShape, mixed_capture_sizes
from octavo.runner.inputs import InputBuilder

BLOCK = 4


def builder() -> InputBuilder:
    return InputBuilder(64, 8, 16, BLOCK, scratch_block=99, device=torch.device("cpu"))


def scheduled(request_id: str, tokens: list[int], computed: int, blocks: list[int]):
    return ScheduledRequest(
        request_id,
        tokens,
        computed,
        sample=True,
        input_is_pending=False,
        num_output_tokens=0,
        block_ids_start=0,
        new_block_ids=blocks,
    )


def test_decode_step_with_graph_padding_orders_longest_first():
    steps = [
        scheduled("a", [7], 5, [3, 8]),  # position 5, context 6
        scheduled("b", [9], 11, [1, 2, 4]),  # position 11, context 12
        scheduled("c", [4], 0, [6]),  # position 0, context 1
    ]
    step = builder().build(steps, GraphShape(4, 4, True), {}, None)
    md = step.md
    assert step.input_ids.tolist() == [7, 9, 4, 0]
    assert step.positions.tolist() == [5, 11, 0, 0]
    # slot = block_table[pos // 4] * 4 + pos % 4; the padding row writes the scratch block
    assert md.slot_mapping.tolist() == [8 * 4 + 1, 4 * 4 + 3, 6 * 4, 99 * 4]
    assert md.seq_lens.tolist() == [6, 12, 1, 1]
    assert md.block_tables[3, 0] == 99
    assert md.decode_order.tolist() == [1, 0, 2, 3]  # by context length, ties in row order
    assert sorted(md.decode_order.tolist()) == list(range(4))


def test_a_model_with_sliding_layers_gets_their_slots_and_tables_padded_as_the_others():
    """Gemma's sliding layers (core/hybrid_kv.py): md.sliding has the same rows from the
    second table, and padding names the sliding pool's own scratch block."""
    hybrid = InputBuilder(64, 8, 16, BLOCK, scratch_block=99, device=torch.device("cpu"),
                          sliding_scratch=50)  # fmt: skip
    a = scheduled("a", [7, 8, 9], 5, [3, 8])  # positions 5-7: block 1
    a.new_sliding_block_ids = [0, 12]  # block 0 is before the window: a stand-in
    b = scheduled("b", [1], 0, [5])
    b.new_sliding_block_ids = [6]
    md = hybrid.build([a, b], GraphShape(8, 4, False), {}, None).md
    assert md.slot_mapping.tolist()[:4] == [8 * 4 + 1, 8 * 4 + 2, 8 * 4 + 3, 5 * 4]
    assert md.sliding.slot_mapping.tolist() == [49, 50, 51, 24] + [50 * 4] * 4
    assert md.sliding.block_tables.tolist() == [[0, 12], [6, 0], [50, 0], [50, 0]]
    assert md.block_tables[2:, 0].tolist() == [99, 99]
    assert md.sliding.query_start_loc is md.query_start_loc and md.sliding.sliding is None


def test_prefill_step_has_no_decode_order():
    steps = [scheduled("a", [7], 5, [3, 8]), scheduled("b", [1, 2, 3], 0, [5])]
    step = builder().build(steps, None, {}, None)
    md = step.md
    assert md.decode_order is None
    assert step.positions.tolist() == [5, 0, 1, 2]
    assert md.query_start_loc.tolist() == [0, 1, 4]
    assert md.slot_mapping.tolist() == [8 * 4 + 1, 20, 21, 22]
    assert md.seq_lens.tolist() == [6, 3]


def test_mixed_step_with_graph_padding():
    """Padding tokens belong to no sequence and write only the scratch block; padding
    sequences have no tokens; the host-side lengths stay the real ones."""
    steps = [scheduled("a", [7], 5, [3, 8]), scheduled("b", [1, 2, 3], 0, [5])]
    step = builder().build(steps, GraphShape(16, 8, False), {}, None)
    md = step.md
    assert step.input_ids.tolist() == [7, 1, 2, 3] + [0] * 12
    assert step.positions.tolist() == [5, 0, 1, 2] + [0] * 12
    assert md.slot_mapping.tolist() == [8 * 4 + 1, 20, 21, 22] + [99 * 4] * 12
    assert md.query_start_loc.tolist() == [0, 1, 4] + [4] * 6
    assert md.seq_lens.tolist() == [6, 3] + [0] * 6
    assert md.block_tables[2:, 0].tolist() == [99] * 6
    assert md.decode_order is None
    assert (md.num_tokens, md.num_seqs, md.max_query_len) == (4, 2, 3)
    assert md.query_start_loc_cpu == [0, 1, 4]


def test_mixed_padding_overwrites_a_larger_earlier_step():
    """A graph reads the whole padded buffers: what an earlier, larger step left past the
    real tokens must not reach a live cache slot."""
    b = builder()
    b.build([scheduled("a", list(range(1, 13)), 5, [1, 2, 3, 7, 8])], None, {}, None)
    b.build([scheduled(r, [3], 9, [6, 6, 6]) for r in "defgh"], GraphShape(8, 8, True), {}, None)
    step = b.build([scheduled("c", [5, 6], 0, [4])], GraphShape(16, 8, False), {}, None)
    md = step.md
    assert step.input_ids.tolist() == [5, 6] + [0] * 14
    assert step.positions.tolist() == [0, 1] + [0] * 14
    assert md.slot_mapping.tolist() == [16, 17] + [99 * 4] * 14
    assert md.query_start_loc.tolist() == [0, 2] + [2] * 7
    assert md.seq_lens.tolist() == [2] + [0] * 7
    assert md.block_tables[1:, 0].tolist() == [99] * 7


def test_decode_padding_after_a_mixed_step():
    """A decode graph's padding rows are one-token sequences again after a mixed step left
    empty sequences and stray tokens in the buffers."""
    b = builder()
    b.build([scheduled("c", list(range(10)), 0, [4, 5, 6])], GraphShape(16, 8, False), {}, None)
    step = b.build([scheduled("a", [7], 5, [3, 8])], GraphShape(4, 4, True), {}, None)
    md = step.md
    assert step.input_ids.tolist() == [7, 0, 0, 0]
    assert md.slot_mapping.tolist() == [8 * 4 + 1] + [99 * 4] * 3
    assert md.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert md.seq_lens.tolist() == [6, 1, 1, 1]
    assert md.block_tables[1:, 0].tolist() == [99] * 3


def test_mixed_capture_sizes():
    assert mixed_capture_sizes(0) == []
    assert mixed_capture_sizes(8) == []
    assert mixed_capture_sizes(40) == [16, 32, 40]
    sizes = mixed_capture_sizes(512)
    assert sizes[:3] == [16, 32, 48] and sizes[-3:] == [448, 480, 512]
    assert sizes == sorted(set(sizes))


@given(
    max_num_seqs=st.integers(1, 64),
    max_mixed=st.integers(0, 600),
    num_tokens=st.integers(1, 700),
    data=st.data(),
)
def test_shape_for_pads_up_to_a_captured_shape(max_num_seqs, max_mixed, num_tokens, data):
    num_seqs = data.draw(st.integers(1, num_tokens))
    graphs = CudaGraphRunner(None, None, max_num_seqs, max_mixed)
    shape = graphs.shape_for(num_tokens, num_seqs)
    decode = num_tokens == num_seqs
    if shape is None:
        largest = max_num_seqs if decode else max(mixed_capture_sizes(max_mixed), default=0)
        assert num_seqs > max_num_seqs or num_tokens > largest
        return
    assert shape in graphs.shapes()
    assert shape.decode == decode
    assert shape.num_tokens >= num_tokens and shape.num_seqs >= num_seqs
    # the smallest that fits: no captured shape of the same kind lies in between
    assert not any(
        s.decode == decode and num_tokens <= s.num_tokens < shape.num_tokens
        for s in graphs.shapes()
    )
