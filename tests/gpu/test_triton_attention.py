"""The Triton attention kernels against the torch reference, on fresh random inputs.

On CUDA the full matrix runs: head_dim 64 and 128, GQA groups 1-8 (and odd ones), pages of
16 and 32, contexts 1..8k, bf16 and fp16, and an fp8 (e4m3) cache with k/v scales. With
OCTAVO_TRITON_INTERPRET=1 a small subset runs on the CPU through Triton's interpreter (see
conftest.py).

Every kernel output buffer is poisoned with NaN first, so an element the kernel forgot to write
fails the NaN check; the cache is filled with random data, so a wrong page or slot fails the
error check.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("OCTAVO_TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA (or OCTAVO_TRITON_INTERPRET=1)", allow_module_level=True)

from attention_reference import reference_attention

from octavo.attention.backend import AttentionMetadata, AttentionSpec, build_metadata
from octavo.attention.torch_backend import (
    FP8,
    TorchAttentionBackend,
    to_kv_cache,
    write_kv_cache,
)
from octavo.attention.triton_backend import TritonAttentionBackend
from octavo.kernels.decode_attention import (
    MAX_SPLITS,
    choose_num_splits,
    decode_attention,
)
from octavo.kernels.prefill_attention import prefill_attention
from octavo.kernels.store_kv import store_kv
from octavo.model.layers import RMSNorm
from octavo.model.rotary import RotaryEmbedding

pytestmark = pytest.mark.gpu
DEVICE = "cpu" if INTERPRET else "cuda"
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-3}


def full_or_small(full: list, small: list) -> list:
    """The GPU parameter list, or its small subset under the interpreter."""
    return small if INTERPRET else full


HEAD_DIMS = full_or_small([64, 128], [64])
GROUPS = full_or_small([1, 2, 4, 8], [1, 4])
BLOCK_SIZES = full_or_small([16, 32], [16, 32])
DTYPES = full_or_small([torch.bfloat16, torch.float16], [torch.bfloat16, torch.float16])

# (query_lens, seq_lens): new tokens of each sequence and its whole context.
PREFILL_BATCHES = {
    "prompts": full_or_small(
        ([1, 17, 100, 300, 64], [1, 17, 100, 300, 64]), ([1, 17, 70], [1, 17, 70])
    ),
    "prefix_then_new": full_or_small(
        ([50, 1, 200, 33, 16, 10], [50 + 64, 1000, 1200, 33, 16 + 16 * 9, 10 + 62]),
        ([5, 1, 20, 10], [5 + 32, 40, 70, 10 + 62]),  # prefix 62: diagonal at a chunk edge
    ),
    "decodes_mixed_in": full_or_small(
        ([1, 1, 128, 1, 64, 1], [5, 700, 128, 1, 64 + 112, 2049]), ([1, 1, 30, 1], [5, 33, 30, 1])
    ),
    "long": full_or_small(([2048, 1, 7], [8192, 8000, 4096 + 7]), ([40], [200])),
}
DECODE_SEQ_LENS = full_or_small(
    [1, 15, 16, 17, 31, 33, 64, 65, 300, 1000, 2049, 4096, 8192, 777, 5000, 2],
    [1, 16, 17, 33, 100, 257],
)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    extra_table_width: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random q/k/v, a cache full of random data, and block tables over shuffled pages."""
    pages = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(pages) + 4
    perm = torch.randperm(num_blocks).tolist()
    tables, used = [], 0
    for n in pages:
        tables.append(perm[used : used + n])
        used += n
    md = build_metadata(query_lens, seq_lens, tables, block_size, DEVICE)
    if extra_table_width:  # a wider table, as CUDA graphs use; padding must not matter
        padding = torch.zeros(len(seq_lens), extra_table_width, dtype=torch.int32, device=DEVICE)
        md = dataclasses.replace(md, block_tables=torch.cat([md.block_tables, padding], 1))
    num_tokens, num_heads = sum(query_lens), num_kv_heads * group
    q = torch.randn(num_tokens, num_heads, head_dim, device=DEVICE).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE)
    return q, k, v, cache.to(dtype), md


# ---------------------------------------------------------------- store_kv


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_kv_heads,head_dim", full_or_small([(8, 128), (2, 64), (3, 64)], [(2, 64), (3, 16)])
)
def test_store_kv_writes_exactly_the_mapped_slots(dtype, num_kv_heads, head_dim):
    """Each token's k/v lands bit-exact in its slot; every other slot keeps its old bits."""
    num_blocks, block_size, num_tokens = 16, 16, 37
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    # k and v as column slices of a fused projection: token stride != KVH * D.
    fused = torch.randn(num_tokens, 3, num_kv_heads * head_dim, device=DEVICE).to(dtype)
    k = fused[:, 1].view(num_tokens, num_kv_heads, head_dim)
    v = fused[:, 2].view(num_tokens, num_kv_heads, head_dim)
    expected = cache.clone()
    write_kv_cache(k, v, expected, slots)
    store_kv(k, v, cache, slots)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_e4m3_over_the_scales(dtype):
    """Into an fp8 cache each token's k / k_scale and v / v_scale land as the torch backend
    rounds them, clamped to +-448, bit for bit; other slots keep their old bits."""
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 8, 16, 2, 64, 37
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE).to(FP8)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    k = (torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE) * 300).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    expected = cache.clone()
    write_kv_cache(k, v, expected, slots, 2.0, 0.25)  # powers of two: exact divisions
    store_kv(k, v, cache, slots, 2.0, 0.25)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    assert cache.float().abs().max() == 448


# ---------------------------------------------------------------- prefill / extend


@pytest.mark.parametrize("batch", list(PREFILL_BATCHES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_prefill_matches_reference(batch, dtype, block_size, group, head_dim):
    """Causal attention over cached prefix + new tokens, every row written, any length mix."""
    query_lens, seq_lens = PREFILL_BATCHES[batch]
    q, k, v, cache, md = make_batch(query_lens, seq_lens, 2, group, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    ref = reference_attention(q, k, v, cache.clone(), md, scale)
    store_kv(k, v, cache, md.slot_mapping)
    out = torch.full_like(q, float("nan"))
    prefill_attention(
        q, cache, md.query_start_loc, md.seq_lens, md.block_tables, scale, md.num_seqs, out=out
    )
    assert not out.isnan().any(), "some output elements were not written"
    assert rel_err(out, ref) < TOLERANCE[dtype]


def pad_for_graph(md: AttentionMetadata, num_tokens: int, num_seqs: int) -> AttentionMetadata:
    """The metadata a mixed-step CUDA graph replays with: tokens past the real ones belong to
    no sequence, and sequences past the real ones have no tokens (runner/inputs.py)."""
    extra_seqs, real_tokens = num_seqs - md.num_seqs, md.num_tokens
    tail = torch.full((extra_seqs,), real_tokens, dtype=torch.int32, device=DEVICE)
    zeros = torch.zeros(extra_seqs, dtype=torch.int32, device=DEVICE)
    table_pad = torch.zeros(extra_seqs, md.block_tables.shape[1], dtype=torch.int32, device=DEVICE)
    return dataclasses.replace(
        md,
        num_tokens=num_tokens,
        query_start_loc=torch.cat([md.query_start_loc, tail]),
        seq_lens=torch.cat([md.seq_lens, zeros]),
        block_tables=torch.cat([md.block_tables, table_pad]),
        seq_lens_cpu=md.seq_lens_cpu + [0] * extra_seqs,
    )


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_prefill_with_graph_padding_gives_the_real_rows(block_size):
    """Padded as a mixed-step graph pads (more tokens and sequences than the step has), the
    kernel writes the real rows as without padding, and no padding program writes them."""
    query_lens, seq_lens = ([1, 20, 1, 9], [60, 20, 2, 30])
    q, k, v, cache, md = make_batch(query_lens, seq_lens, 2, 2, 64, block_size, torch.bfloat16)
    ref = reference_attention(q, k, v, cache.clone(), md, 0.125)
    store_kv(k, v, cache, md.slot_mapping)
    real = md.num_tokens
    padded = pad_for_graph(md, real + 35, md.num_seqs + 12)
    q_pad = torch.cat([q, torch.randn(35, *q.shape[1:], device=DEVICE).to(q.dtype)])
    out = torch.full_like(q_pad, float("nan"))
    prefill_attention(
        q_pad, cache, padded.query_start_loc, padded.seq_lens, padded.block_tables, 0.125,
        padded.num_seqs, out=out,
    )  # fmt: skip
    assert not out[:real].isnan().any(), "some real rows were not written"
    assert out[real:].isnan().all(), "a padding token was attended"
    assert rel_err(out[:real], ref) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(6, 2), (28, 4), (16, 1)])
def test_prefill_odd_and_wide_groups(num_heads, num_kv_heads):
    """Group sizes that are not powers of two (padded head rows) and a 16-wide group."""
    query_lens, seq_lens = (
        ([1, 30, 7], [40, 30, 70]) if INTERPRET else ([1, 300, 77], [400, 300, 1070])
    )
    group = num_heads // num_kv_heads
    q, k, v, cache, md = make_batch(
        query_lens, seq_lens, num_kv_heads, group, 64, 16, torch.bfloat16
    )
    ref = reference_attention(q, k, v, cache.clone(), md, 0.125)
    store_kv(k, v, cache, md.slot_mapping)
    out = torch.full_like(q, float("nan"))
    prefill_attention(
        q, cache, md.query_start_loc, md.seq_lens, md.block_tables, 0.125, md.num_seqs, out=out
    )
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]


# ---------------------------------------------------------------- decode


@pytest.mark.parametrize("num_splits", [None, 1, 3, 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_decode_matches_reference(num_splits, dtype, block_size, group, head_dim):
    """One query per sequence over contexts of 1..8k, split-K or not, every row written."""
    seq_lens = DECODE_SEQ_LENS
    q, k, v, cache, md = make_batch(
        [1] * len(seq_lens), seq_lens, 2, group, head_dim, block_size, dtype, extra_table_width=3
    )
    scale = head_dim**-0.5
    ref = reference_attention(q, k, v, cache.clone(), md, scale)
    store_kv(k, v, cache, md.slot_mapping)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, cache, md.seq_lens, md.block_tables, scale, num_splits, out=out)
    assert not out.isnan().any(), "some output elements were not written"
    assert rel_err(out, ref) < TOLERANCE[dtype]


# (window, soft cap): windows narrower than a KV chunk and wider than some contexts; Gemma 2's
# soft cap alone and with a window.
WINDOWS = [(w, None) for w in full_or_small([1, 17, 64, 1000], [1, 17, 64])]
WINDOWS += [(None, 1.5), (17, 1.5)]


@pytest.mark.parametrize("window,softcap", WINDOWS)
@pytest.mark.parametrize("batch", ["prefix_then_new", "decodes_mixed_in", "long"])
def test_prefill_over_a_sliding_window_matches_reference(batch, window, softcap):
    """Each query sees its last `window` positions (its scores soft-capped where asked):
    chunks behind a cached prefix, decode rows mixed in."""
    query_lens, seq_lens = PREFILL_BATCHES[batch]
    q, k, v, cache, md = make_batch(query_lens, seq_lens, 2, 4, 64, 16, torch.bfloat16)
    ref = reference_attention(q, k, v, cache.clone(), md, 0.125, window=window, softcap=softcap)
    store_kv(k, v, cache, md.slot_mapping)
    out = torch.full_like(q, float("nan"))
    prefill_attention(
        q, cache, md.query_start_loc, md.seq_lens, md.block_tables, 0.125, md.num_seqs,
        out=out, window=window, softcap=softcap,
    )  # fmt: skip
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("window,softcap", WINDOWS)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_over_a_sliding_window_matches_reference(num_splits, window, softcap):
    """The splits cover the window's positions only; contexts shorter than the window see
    them all; scores soft-capped where asked."""
    seq_lens = DECODE_SEQ_LENS
    q, k, v, cache, md = make_batch(
        [1] * len(seq_lens), seq_lens, 2, 4, 64, 16, torch.bfloat16, extra_table_width=3
    )
    ref = reference_attention(q, k, v, cache.clone(), md, 0.125, window=window, softcap=softcap)
    store_kv(k, v, cache, md.slot_mapping)
    out = torch.full_like(q, float("nan"))
    decode_attention(
        q, cache, md.seq_lens, md.block_tables, 0.125, num_splits, out=out, window=window,
        softcap=softcap,
    )  # fmt: skip
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_order_changes_only_the_schedule(num_splits):
    """Given an order (any permutation of the sequences), each sequence still gets exactly its
    own output: the order only says which program starts first."""
    seq_lens = DECODE_SEQ_LENS
    q, k, v, cache, md = make_batch(
        [1] * len(seq_lens), seq_lens, 2, 4, 64, 16, torch.bfloat16, extra_table_width=2
    )
    store_kv(k, v, cache, md.slot_mapping)
    plain = decode_attention(q, cache, md.seq_lens, md.block_tables, 0.125, num_splits)
    for order in (torch.argsort(md.seq_lens, descending=True), torch.randperm(len(seq_lens))):
        out = torch.full_like(q, float("nan"))
        decode_attention(
            q,
            cache,
            md.seq_lens,
            md.block_tables,
            0.125,
            num_splits,
            out=out,
            order=order.to(device=DEVICE, dtype=torch.int32),
        )
        assert torch.equal(out, plain)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_padding_sequence_gives_zeros(num_splits):
    """A seq_len-0 row (CUDA-graph padding) yields zeros, not NaN, and leaves others intact."""
    q, k, v, cache, md = make_batch([1, 1], [40, 1], 2, 2, 64, 16, torch.bfloat16)
    ref = reference_attention(q, k, v, cache.clone(), md, 0.125)
    store_kv(k, v, cache, md.slot_mapping)
    seq_lens = md.seq_lens.clone()
    seq_lens[1] = 0
    out = torch.full_like(q, float("nan"))
    decode_attention(q, cache, seq_lens, md.block_tables, 0.125, num_splits, out=out)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert rel_err(out[0], ref[0]) < TOLERANCE[torch.bfloat16]


FP8_SCALES = {"k_scale": 0.37, "v_scale": 1.7}
# The reference rounds e4m3 x scale to bfloat16 where the kernels fold the scales into fp32
# factors: two bfloat16 roundings apart, not one.
FP8_TOLERANCE = 2 * TOLERANCE[torch.bfloat16]


def fp8_batch(query_lens: list[int], seq_lens: list[int], group: int, head_dim: int):
    """make_batch's batch over an e4m3 cache with FP8_SCALES, this step's k/v stored by
    store_kv, and the reference's output: (q, cache, md, reference)."""
    q, k, v, cache, md = make_batch(query_lens, seq_lens, 2, group, head_dim, 16, torch.bfloat16)
    k_scale, v_scale = FP8_SCALES.values()
    cache = torch.cat([to_kv_cache(cache[:1], FP8, k_scale), to_kv_cache(cache[1:], FP8, v_scale)])
    ref = reference_attention(q, k, v, cache.clone(), md, head_dim**-0.5, k_scale, v_scale)
    store_kv(k, v, cache, md.slot_mapping, k_scale, v_scale)
    return q, cache, md, ref


@pytest.mark.parametrize("batch", ["prefix_then_new", "decodes_mixed_in"])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_prefill_over_an_fp8_cache_matches_reference(batch, group, head_dim):
    """Prefill reads what the reference reads from an e4m3 cache: e4m3 times its scale."""
    q, cache, md, ref = fp8_batch(*PREFILL_BATCHES[batch], group, head_dim)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, cache, md.query_start_loc, md.seq_lens, md.block_tables,
                      head_dim**-0.5, md.num_seqs, out=out, **FP8_SCALES)  # fmt: skip
    assert not out.isnan().any(), "some output elements were not written"
    assert rel_err(out, ref) < FP8_TOLERANCE


@pytest.mark.parametrize("num_splits", full_or_small([None, 1, 3], [1, 3]))
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_decode_over_an_fp8_cache_matches_reference(num_splits, group, head_dim):
    """Decode, split-K or not, reads what the reference reads from an e4m3 cache."""
    seq_lens = DECODE_SEQ_LENS
    q, cache, md, ref = fp8_batch([1] * len(seq_lens), seq_lens, group, head_dim)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, cache, md.seq_lens, md.block_tables, head_dim**-0.5, num_splits,
                     out=out, **FP8_SCALES)  # fmt: skip
    assert not out.isnan().any(), "some output elements were not written"
    assert rel_err(out, ref) < FP8_TOLERANCE


def test_num_splits_depend_on_shapes_only():
    """The split count fills ~2 waves of 132 SMs, stays a power of two, and is 1 when the
    batch alone fills the GPU; it takes no per-step data (so CUDA-graph grids are fixed)."""
    assert choose_num_splits(256, 8, 1024, 132) == 1
    assert choose_num_splits(1, 8, 8192, 132) == 32
    assert choose_num_splits(1, 8, 100, 132) == 1  # too short to be worth splitting
    for batch in (1, 3, 17, 64):
        for context in (16, 1000, 40960):
            splits = choose_num_splits(batch, 8, context, 132)
            assert 1 <= splits <= MAX_SPLITS and splits & (splits - 1) == 0


# ---------------------------------------------------------------- backend


@pytest.mark.parametrize(
    "query_lens,seq_lens",
    full_or_small(
        [([1] * 64, [1 + 37 * i for i in range(64)]), ([1, 200, 1, 33], [900, 200, 2, 100])],
        [([1] * 5, [1, 16, 40, 90, 3]), ([1, 20, 1, 9], [60, 20, 2, 30])],
    ),
)
def test_backend_qwen3_shapes(query_lens, seq_lens):
    """forward() (store, then decode or extend) at Qwen3-0.6B head shapes, against the oracle,
    with q/k/v as slices of one fused projection the way the model hands them over."""
    num_tokens, heads, kv_heads, head_dim = sum(query_lens), 16, 8, 128
    _, _, _, cache, md = make_batch(query_lens, seq_lens, kv_heads, 2, head_dim, 16, torch.bfloat16)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, device=DEVICE).bfloat16()
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    q = q.view(num_tokens, heads, head_dim)
    k = k.view(num_tokens, kv_heads, head_dim)
    v = v.view(num_tokens, kv_heads, head_dim)
    ref = reference_attention(q, k, v, cache.clone(), md, head_dim**-0.5)
    out = TritonAttentionBackend().forward(q, k, v, cache, md, head_dim**-0.5)
    assert out.shape == (num_tokens, heads, head_dim) and not out.isnan().any()
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("fp8", [False, True])
def test_backend_decode_replays_in_a_cuda_graph(fp8):
    """Decode captured once replays correctly with new lengths and pages copied into the same
    metadata buffers (the launch grid depends on shapes only); over an e4m3 cache too, whose
    scales the graph keeps."""
    backend, heads, kv_heads, head_dim, batch, width = TritonAttentionBackend(), 16, 8, 128, 8, 64
    cache = torch.randn(2, batch * width, 16, kv_heads, head_dim, device=DEVICE)
    cache = cache.to(FP8) if fp8 else cache.bfloat16()
    scales = FP8_SCALES if fp8 else {}
    qkv = [
        torch.randn(batch, n, head_dim, device=DEVICE).bfloat16()
        for n in (heads, kv_heads, kv_heads)
    ]

    def step_md(seq_lens: list[int]) -> AttentionMetadata:
        pages = torch.randperm(batch * width).view(batch, width).tolist()
        return build_metadata([1] * batch, seq_lens, pages, 16, DEVICE)

    md = step_md([16 * width] * batch)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(*qkv, cache, md, 0.1, **scales)  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = backend.forward(*qkv, cache, md, 0.1, **scales)
    torch.cuda.current_stream().wait_stream(stream)
    for seq_lens in ([5, 1000, 17, 1, 1024, 300, 64, 65], [1] * batch):
        new = step_md(seq_lens)
        for name in ("seq_lens", "slot_mapping", "block_tables", "query_start_loc"):
            getattr(md, name).copy_(getattr(new, name))
        for buf in qkv:
            buf.copy_(torch.randn_like(buf))
        ref = reference_attention(*qkv, cache.clone(), new, 0.1, **scales)
        graph.replay()
        assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need a GPU")
def test_backend_extend_replays_in_a_cuda_graph():
    """A mixed step (prompts, chunks behind a prefix, decode rows) captured once at padded
    sizes replays correctly with other lengths, pages and sequence counts copied into the
    same metadata buffers: the prefill grid depends on the padded sizes only."""
    backend, heads, kv_heads, head_dim = TritonAttentionBackend(), 16, 8, 128
    num_tokens, num_seqs, width = 256, 16, 64
    cache = torch.randn(2, num_seqs * width, 16, kv_heads, head_dim, device=DEVICE).bfloat16()
    q = torch.randn(num_tokens, heads, head_dim, device=DEVICE).bfloat16()

    def step_md(query_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
        pages = torch.randperm(num_seqs * width)[: len(seq_lens) * width]
        md = build_metadata(query_lens, seq_lens, pages.view(-1, width).tolist(), 16, DEVICE)
        return pad_for_graph(md, num_tokens, num_seqs)

    md = step_md([num_tokens], [num_tokens])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.attend(q, cache, md, 0.1)  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = backend.attend(q, cache, md, 0.1)
    torch.cuda.current_stream().wait_stream(stream)
    steps = [
        ([1, 100, 1, 30], [700, 100, 5, 1000]),
        ([200, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 40], [200] + [17 * i for i in range(1, 15)] + [1000]),
        ([3], [3]),
    ]  # fmt: skip
    for query_lens, seq_lens in steps:
        new = step_md(query_lens, seq_lens)
        for name in ("seq_lens", "block_tables", "query_start_loc"):
            getattr(md, name).copy_(getattr(new, name))
        q.copy_(torch.randn_like(q))
        real = sum(query_lens)
        # the reference stores nothing new: its k/v are what the cache already holds
        slots = new.slot_mapping
        k = cache[0].view(-1, kv_heads, head_dim)[slots]
        v = cache[1].view(-1, kv_heads, head_dim)[slots]
        real_md = build_metadata(
            query_lens, seq_lens, new.block_tables[: len(seq_lens)].tolist(), 16, DEVICE
        )
        ref = reference_attention(q[:real], k, v, cache.clone(), real_md, 0.1)
        graph.replay()
        assert rel_err(out[:real], ref) < TOLERANCE[torch.bfloat16]


@pytest.mark.skipif(INTERPRET, reason="synchronization checks need a GPU")
def test_backend_never_synchronizes_with_the_host():
    """Neither the decode nor the extend path reads the device from the host (no .item()),
    from q/k/v or from the qkv projection, fused decode on and off."""
    backend = TritonAttentionBackend()
    mixed = make_batch([1, 300, 1], [500, 300, 9], 8, 2, 128, 16, torch.bfloat16)
    decode = make_batch([1, 1, 1], [500, 3000, 9], 8, 2, 128, 16, torch.bfloat16)
    spec = _spec(16, 8, 128, qk_norm=True, dtype=torch.bfloat16, device=DEVICE)

    def run_all() -> None:
        for q, k, v, cache, md in (mixed, decode):
            backend.forward(q, k, v, cache, md, 0.1)
            qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
            positions = torch.zeros(qkv.shape[0], dtype=torch.int64, device=DEVICE)
            for fused in (True, False):
                backend.decodes_from_qkv = fused
                backend.forward_qkv(qkv, positions, cache, md, spec)

    run_all()  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_all()
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ---------------------------------------------------------------- from the qkv projection


def _spec(
    heads: int, kv_heads: int, head_dim: int, qk_norm: bool, dtype: torch.dtype, device: str
) -> AttentionSpec:
    """A layer's spec with Qwen3's rope (and, if qk_norm, its per-head norms with random
    weights), its modules in `dtype` on `device` as the model holds them."""
    torch.manual_seed(heads + head_dim)
    rope = RotaryEmbedding(head_dim, 4096, 1_000_000.0).to(device)
    norms = (None, None)
    if qk_norm:
        norms = tuple(RMSNorm(head_dim, 1e-6) for _ in range(2))
        for norm in norms:
            norm.weight.data.normal_(1, 0.3)
            norm.to(device, dtype)
    return AttentionSpec(heads, kv_heads, head_dim, head_dim**-0.5, rope, *norms)


def _on_cpu_in_float32(spec: AttentionSpec) -> AttentionSpec:
    """The same spec with copies of its modules on the CPU in float32 (the oracle's)."""
    norms = [n if n is None else RMSNorm(spec.head_dim, n.eps) for n in (spec.q_norm, spec.k_norm)]
    for copy, norm in zip(norms, (spec.q_norm, spec.k_norm), strict=True):
        if copy is not None:
            copy.weight.data.copy_(norm.weight.float().cpu())
    rope = RotaryEmbedding(spec.head_dim, spec.rotary_emb.cos_sin_cache.shape[0], 1_000_000.0)
    return dataclasses.replace(spec, rotary_emb=rope, q_norm=norms[0], k_norm=norms[1])


# bf16 q and k are rounded once more than in the attention tests above (after the norm and
# the rotation); a wrong norm weight or position is several times further off.
FORWARD_QKV_TOLERANCE = 2e-2
FORWARD_QKV_BATCHES = {
    "decode": full_or_small(([1] * 6, [1, 17, 64, 65, 300, 129]), ([1] * 3, [1, 17, 33])),
    "mixed": full_or_small(
        ([1, 100, 1, 30, 7], [700, 100, 5, 94, 7]), ([1, 20, 1, 9], [40, 20, 5, 30])
    ),
}


@pytest.mark.parametrize("batch", list(FORWARD_QKV_BATCHES))
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("fused_decode", [True, False])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("window,softcap", [(None, None), (24, None), (24, 0.5)])
@torch.no_grad()
def test_forward_qkv_matches_the_torch_backend(batch, qk_norm, fused_decode, fp8, window,
                                               softcap):  # fmt: skip
    """The model's path (qkv -> q/k norm, rotary, K/V store, attention) through the Triton
    backend's kernels equals the torch backend's float32 run of the same layer on the CPU, in
    its output and in the cache slots it writes; a decode step through the one fused kernel
    and through the two-kernel path (`decodes_from_qkv` off) alike; a bf16 cache and an e4m3
    one with k/v scales alike (powers of two, so both divide exactly)."""
    query_lens, seq_lens = FORWARD_QKV_BATCHES[batch]
    heads, kv_heads = full_or_small((16, 8), (4, 2))
    head_dim, block_size, dtype = full_or_small(128, 32), 16, torch.bfloat16
    spec = _spec(heads, kv_heads, head_dim, qk_norm, dtype, DEVICE)
    spec = dataclasses.replace(spec, sliding_window=window, logit_softcap=softcap)
    _, _, _, cache, md = make_batch(query_lens, seq_lens, kv_heads, heads // kv_heads, head_dim,
                                    block_size, dtype)  # fmt: skip
    scales = {"k_scale": 0.5, "v_scale": 2.0} if fp8 else {}
    cache = cache.to(FP8) if fp8 else cache
    num_tokens = sum(query_lens)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width + 8, device=DEVICE).to(dtype)[:, :width]  # strided rows
    positions = torch.tensor(
        [s - q + j for q, s in zip(query_lens, seq_lens, strict=True) for j in range(q)],
        device=DEVICE,
    )
    cpu_md = build_metadata(query_lens, seq_lens, md.block_tables.tolist(), block_size)
    want_cache = cache.cpu() if fp8 else cache.float().cpu()
    want = TorchAttentionBackend().forward_qkv(
        qkv.float().cpu(), positions.cpu(), want_cache, cpu_md, _on_cpu_in_float32(spec), **scales
    )

    backend = TritonAttentionBackend()
    backend.decodes_from_qkv = fused_decode
    got = backend.forward_qkv(qkv, positions, cache, md, spec, **scales)
    assert got.shape == (num_tokens, heads, head_dim) and got.dtype == dtype
    assert not got.isnan().any()
    assert rel_err(got.cpu(), want) < FORWARD_QKV_TOLERANCE
    slots = md.slot_mapping.cpu()
    got_kv = cache.cpu().view(2, -1, kv_heads, head_dim)[:, slots]
    want_kv = want_cache.view(2, -1, kv_heads, head_dim)[:, slots]
    assert rel_err(got_kv[0], want_kv[0]) < FORWARD_QKV_TOLERANCE  # rotated (and normed) k
    assert torch.equal(got_kv[1].float(), want_kv[1].float())  # v as projected
