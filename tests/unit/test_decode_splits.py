"""The decode split count (octavo/kernels/decode_splits.py): a plain function of the launch's
shape and the step's mean context, so that the CUDA-graph ladder can plan it."""

from hypothesis import given
from hypothesis import strategies as st

from octavo.kernels.decode_splits import MAX_SPLITS, choose_num_splits, decode_split_variants


def test_splits_fill_the_gpu_twice_and_stop_once_the_batch_fills_it():
    assert choose_num_splits(256, 8, 1024, 132) == 1
    assert choose_num_splits(1, 8, 8192, 132) == 32
    assert choose_num_splits(16, 8, 40960, 132) == 2  # 128 programs: cdiv(264, 128) = 3 -> 2
    assert choose_num_splits(1, 8, 100, 132) == 1  # the table is too short to be worth it


def test_long_contexts_split_finer_while_the_batch_fills_a_quarter_to_three_waves():
    """The shapes measured in session 17 (docs/PERFORMANCE.md) pick their best count."""
    assert choose_num_splits(16, 8, 40960, 132, context=3636) == 4  # 2 by batch alone
    assert choose_num_splits(48, 8, 40960, 132, context=3900) == 2  # 384 programs < 396
    assert choose_num_splits(8, 8, 40960, 132, context=8285) == 16  # 4 by batch alone
    assert choose_num_splits(64, 8, 40960, 132, context=4040) == 1  # 512 programs: 3.9 waves
    assert choose_num_splits(2, 8, 40960, 132, context=8761) == 16  # 16 programs < 33
    assert choose_num_splits(48, 8, 40960, 132, context=2047) == 1  # below LONG_CONTEXT


@given(
    num_seqs=st.integers(1, 512),
    num_kv_heads=st.sampled_from([1, 2, 4, 8, 32]),
    max_context=st.integers(1, 131072),
    sms=st.sampled_from([16, 78, 132]),
    data=st.data(),
)
def test_every_count_is_a_captured_variant(num_seqs, num_kv_heads, max_context, sms, data):
    """Whatever mean context a step has (at most the table's), its count is a power of two
    within bounds, among the variants the graph runner captures, and never fewer than the
    count for an unknown context."""
    context = data.draw(st.integers(0, max_context))
    splits = choose_num_splits(num_seqs, num_kv_heads, max_context, sms, context)
    assert 1 <= splits <= MAX_SPLITS and splits & (splits - 1) == 0
    variants = decode_split_variants(num_seqs, num_kv_heads, max_context, sms)
    assert splits in variants and variants == sorted(set(variants))
    assert splits >= choose_num_splits(num_seqs, num_kv_heads, max_context, sms)
