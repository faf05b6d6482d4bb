"""Deterministic mode's kernels: a row's bits never depend on what shares its launch.

- fixed_gemm: each row of a product equals the same row computed alone, for every row count
  and every tile the rule can pick, and matches torch's product within rounding.
- attention in fixed spans: a token's output is the same bits whether its step is a whole
  prompt, a chunk behind a cached prefix, a decode step (spans in parallel, then merged), or
  a mix, with any neighbours; and matches the reference within rounding.
"""

from __future__ import annotations

import pytest
import torch
from kernel_env import DEVICE, pick, require_kernels

require_kernels()

from octavo.attention.backend import build_metadata
from octavo.kernels.fixed_gemm import fixed_gemm, tile_config
from octavo.kernels.prefill_attention import prefill_attention

pytestmark = pytest.mark.gpu


# ---------------------------------------------------------------- fixed_gemm

SHAPES = pick([(4096, 4096), (6144, 4096), (4096, 12288), (151936, 4096), (1000, 200)],
              [(96, 80), (40, 300)])  # fmt: skip
ROWS = pick([1, 2, 3, 8, 16, 31, 64, 65, 128, 200, 256, 257, 512, 1024, 4096], [1, 3, 65, 70])


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_fixed_gemm_rows_are_the_same_bits_at_every_row_count(n, k, bias):
    torch.manual_seed(n + k)
    w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) / k**0.5
    b = torch.randn(n, device=DEVICE, dtype=torch.bfloat16) if bias else None
    x = torch.randn(max(ROWS), k, device=DEVICE, dtype=torch.bfloat16)
    alone = torch.cat([fixed_gemm(x[i : i + 1], w, b) for i in range(3)])
    for m in ROWS:
        y = fixed_gemm(x[:m], w, b)
        assert torch.equal(y[: min(m, 3)], alone[: min(m, 3)]), m
    ref = x[:64].float() @ w.float().T + (b.float() if bias else 0)
    assert torch.allclose(fixed_gemm(x[:64], w, b).float(), ref, atol=2e-2, rtol=2e-2)


TILES = pick(
    [(64, 16, 128, 4, 4), (64, 64, 64, 4, 3), (64, 128, 64, 4, 4), (128, 256, 64, 8, 3),
     (128, 128, 128, 8, 3), (64, 256, 64, 8, 3)],
    [(64, 16, 32, 4, 1), (64, 32, 32, 4, 1), (128, 64, 32, 4, 1)],  # numpy sums each dot
)  # fmt: skip


@pytest.mark.skipif(DEVICE != "cuda", reason="cuBLASLt runs on CUDA only")
@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (4096, 12288), (24576, 4096)])
def test_the_product_runs_cublaslt_above_its_threshold_with_fixed_gemms_bits(n, k):
    """FixedOrderProduct: probed cuBLASLt algorithms from SMALL_ROWS rows up (per row count
    below LT_ROWS, per shape above), fixed_gemm below; either way each row's bits are the
    row's alone."""
    from octavo.kernels.fixed_order_product import LT_ROWS, SMALL_ROWS, FixedOrderProduct

    torch.manual_seed(n + k)
    w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) / k**0.5
    x = torch.randn(3000, k, device=DEVICE, dtype=torch.bfloat16)
    product = FixedOrderProduct()
    alone = product(x[:2].contiguous(), w)
    for m in (SMALL_ROWS, 100, 256, 511, LT_ROWS, LT_ROWS + 5, 3000):
        y = product(x[:m].contiguous(), w)
        assert torch.equal(y, fixed_gemm(x[:m], w)), m
        assert torch.equal(y[:2], alone), m
    assert None not in product.algos.values()  # cuBLASLt ran from LT_ROWS up
    assert product.small[(256, n, k, w.dtype, w.device)] is not None  # and at 256 rows


@pytest.mark.skipif(DEVICE != "cuda", reason="cuBLASLt runs on CUDA only")
def test_a_row_count_first_seen_in_a_capture_runs_fixed_gemm():
    from octavo.kernels.fixed_order_product import FixedOrderProduct

    torch.manual_seed(1)
    w = torch.randn(4096, 4096, device=DEVICE, dtype=torch.bfloat16) / 64
    x = torch.randn(300, 4096, device=DEVICE, dtype=torch.bfloat16)
    ref = fixed_gemm(x, w)  # compiled before the capture
    product = FixedOrderProduct()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = product(x, w)
    graph.replay()
    assert product.small == {}  # no probe ran inside the capture
    assert torch.equal(y, ref)


def test_every_tile_gives_the_same_bits():
    n, k = SHAPES[0]
    torch.manual_seed(0)
    w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16)
    x = torch.randn(70, k, device=DEVICE, dtype=torch.bfloat16)
    outs = []
    for bm, bn, bk, warps, stages in TILES:
        cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps,
               "num_stages": stages}  # fmt: skip
        outs.append(fixed_gemm(x, w, config=cfg))
    for tile, y in zip(TILES, outs, strict=True):
        assert torch.equal(y, outs[0]), tile


def test_tile_rule_keeps_at_least_64_rows_a_tile():
    for m in [1, 16, 64, 65, 256, 257, 8192]:
        for n in [256, 4096, 151936]:
            assert tile_config(m, n, 4096)["BLOCK_M"] >= 64


def test_fixed_gemm_refuses_float32():
    x = torch.randn(2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        fixed_gemm(x, x)


# ---------------------------------------------------------------- attention in spans

SPLIT = pick(256, 64)
HEAD_DIM = pick(128, 64)


def _cache_and_q(context: int, num_kv_heads: int, group: int, block_size: int):
    """A random cache holding one sequence's whole context, its block table, and a query
    per context position."""
    pages = -(-context // block_size)
    num_blocks = pages + 3
    table = torch.randperm(num_blocks)[:pages].tolist()
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, HEAD_DIM, device=DEVICE)
    q = torch.randn(context, num_kv_heads * group, HEAD_DIM, device=DEVICE)
    return cache.to(torch.bfloat16), q.to(torch.bfloat16), table


def _reference(q, cache, table, block_size, window):
    """Float32 attention of query p over positions max(0, p - window + 1) .. p."""
    slots = torch.tensor(table, device=DEVICE)[:, None] * block_size
    slots = slots + torch.arange(block_size, device=DEVICE)
    k, v = (cache[i].flatten(0, 1)[slots.flatten()].float() for i in range(2))  # [L, KVH, D]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = torch.empty(q.shape, device=DEVICE)
    for p in range(q.shape[0]):
        lo = 0 if window is None else max(0, p - window + 1)
        s = torch.einsum("hd,lhd->hl", q[p].float(), k[lo : p + 1]) * HEAD_DIM**-0.5
        out[p] = torch.einsum("hl,lhd->hd", s.softmax(-1), v[lo : p + 1])
    return out


def _run(q, cache, steps, table, block_size, window, all_decode=False):
    """Attention of the query rows `steps` = [(first position, new tokens)] of copies of one
    sequence side by side in one launch; returns each copy's rows."""
    q_lens = [n for _, n in steps]
    seq_lens = [p + n for p, n in steps]
    md = build_metadata(q_lens, seq_lens, [table] * len(steps), block_size, DEVICE)
    rows = torch.cat([q[p : p + n] for p, n in steps])
    out = prefill_attention(
        rows, cache, md.query_start_loc, md.seq_lens, md.block_tables, HEAD_DIM**-0.5,
        num_seqs=len(steps), window=window, split=SPLIT, all_decode=all_decode,
    )  # fmt: skip
    return out.split(q_lens)


@pytest.mark.parametrize("window", [None, pick(300, 70)])
@pytest.mark.parametrize("group", pick([1, 4, 5], [1, 4]))
def test_a_tokens_attention_is_the_same_bits_in_every_kind_of_step(window, group):
    torch.manual_seed(group)
    block_size, kv_heads = 16, 2
    context = pick(1100, 150)
    cache, q, table = _cache_and_q(context, kv_heads, group, block_size)
    whole = _run(q, cache, [(0, context)], table, block_size, window)[0]
    ref = _reference(q, cache, table, block_size, window)
    assert torch.allclose(whole.float(), ref, atol=2e-2, rtol=2e-2)

    # Chunks behind a cached prefix, beside other sequences' chunks.
    cut = pick(517, 61)
    chunks = _run(q, cache, [(5, 40), (0, cut), (cut, context - cut)], table, block_size,
                  window)  # fmt: skip
    assert torch.equal(torch.cat(chunks[1:]), whole)
    assert torch.equal(chunks[0], whole[5:45])
    # Decode steps (each span its own program, merged after), alone and beside others.
    last = [context - 1, SPLIT - 1, SPLIT, 2 * SPLIT + 3, 0]
    alone = [_run(q, cache, [(p, 1)], table, block_size, window, True)[0] for p in last]
    together = _run(q, cache, [(p, 1) for p in last], table, block_size, window, True)
    for p, a, t in zip(last, alone, together, strict=True):
        assert torch.equal(a, whole[p : p + 1]), p
        assert torch.equal(t, whole[p : p + 1]), p
    # A decode row mixed into a prefill step takes the merged walk: the same bits again.
    mixed = _run(q, cache, [(0, 30), (context - 1, 1)], table, block_size, window)
    assert torch.equal(mixed[1], whole[-1:])


def test_split_must_be_a_multiple_of_the_chunk():
    cache, q, table = _cache_and_q(20, 1, 1, 16)
    md = build_metadata([20], [20], [table], 16, DEVICE)
    with pytest.raises(ValueError, match="multiple"):
        prefill_attention(q, cache, md.query_start_loc, md.seq_lens, md.block_tables, 1.0,
                          num_seqs=1, split=SPLIT + 1)  # fmt: skip
