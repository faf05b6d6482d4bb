"""octavo's CPU kernels (kernels/cpu_kernels.c): each product and the paged attention against
torch references on fresh random inputs, and every row computed the same whatever else is in
the call (row count, thread count, chunking)."""

from __future__ import annotations

import math
import subprocess

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from octavo.kernels import cpu

pytestmark = pytest.mark.skipif(
    not cpu.available(torch.float32), reason="octavo's CPU kernels could not be built here"
)


def weight(kind: str, n: int, k: int, group: int, generator) -> cpu.PackedWeight:
    """A random weight of `kind` (f32, q4, q8), K padded to whole groups for codes."""
    if kind == "f32":
        return cpu.pack_weight(torch.randn(n, k, generator=generator))
    kp = -(-k // group) * group
    top = 16 if kind == "q4" else 256
    codes = torch.randint(0, top, (n, kp), dtype=torch.uint8, generator=generator)
    codes[:, 0] = top - 1  # so that a Q8 weight never packs as Q4
    scale = torch.rand(n, kp // group, generator=generator) * 0.02 + 1e-3
    lo = -torch.rand(n, kp // group, generator=generator) * 0.1
    return cpu.pack_weight(codes=codes, scale=scale, lo=lo, in_features=k)


def reference(x: torch.Tensor, w: cpu.PackedWeight) -> torch.Tensor:
    return F.linear(x.double(), cpu.dequantize(w).double())


@pytest.mark.parametrize("kind", ["f32", "q4", "q8"])
@pytest.mark.parametrize(
    "rows,k,n,group",
    [(1, 576, 960, 32), (7, 576, 1536, 32), (70, 1536, 576, 128), (3, 40, 9, 32), (130, 64, 5, 64)],
)
def test_linear_matches_the_float64_product(kind, rows, k, n, group):
    """A K that ends inside a run of 16 or a group, N outside whole tiles, row counts that
    take one row, whole tiles, and more than a block of 64 rows."""
    gen = torch.Generator().manual_seed(rows * k + n)
    w = weight(kind, n, k, group, gen)
    assert w.kind == {"f32": cpu.W_F32, "q4": cpu.W_Q4, "q8": cpu.W_Q8}[kind]
    x = torch.randn(rows, k, generator=gen)
    ref = reference(x, w)
    y = cpu.linear(x, w)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-6


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(["f32", "q4", "q8"]),
    k=st.integers(1, 200),
    n=st.integers(1, 40),
    rows=st.integers(2, 140),
    seed=st.integers(0, 2**16),
)
def test_each_row_is_the_same_whatever_else_is_in_the_call(kind, k, n, rows, seed):
    """Bitwise: every row of a product of many rows equals that row's product alone, for
    any shape (one row runs in registers, more dequantize the weight into a buffer first)."""
    gen = torch.Generator().manual_seed(seed)
    w = weight(kind, n, k, 32, gen)
    x = torch.randn(rows, k, generator=gen)
    together = cpu.linear(x, w)
    picks = sorted({0, rows // 2, rows - 1, seed % rows})
    for i in picks:
        assert torch.equal(together[i], cpu.linear(x[i : i + 1], w)[0]), i
    assert torch.equal(together[picks[-1] :], cpu.linear(x[picks[-1] :], w))


def test_the_thread_count_changes_nothing():
    gen = torch.Generator().manual_seed(0)
    w, x = weight("q4", 300, 576, 32, gen), torch.randn(33, 576, generator=gen)
    threads = torch.get_num_threads()
    want = cpu.linear(x, w)
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu.linear(x, w), want)
    finally:
        torch.set_num_threads(threads)


def test_dense_takes_any_leading_shape_and_a_bias():
    gen = torch.Generator().manual_seed(1)
    w, b, x = torch.randn(12, 20, generator=gen), torch.randn(12), torch.randn(2, 3, 20)
    y = cpu.dense(x, w, b)
    assert y.shape == (2, 3, 12)
    assert torch.allclose(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert cpu.dense(x.bfloat16(), w.bfloat16()).dtype == torch.bfloat16  # torch's, not ours


def _paged(keys: torch.Tensor, values: torch.Tensor, block_size: int, gen):
    """Each sequence's [L, KVH, D] keys/values in a shared cache, its blocks in random order."""
    lengths = [k.shape[0] for k in keys]
    counts = [-(-n // block_size) for n in lengths]
    order = torch.randperm(sum(counts) + 3, generator=gen)
    kvh, d = keys[0].shape[1:]
    cache = torch.zeros(2, len(order), block_size, kvh, d)
    tables = torch.zeros(len(lengths), max(counts), dtype=torch.int32)
    used = 0
    for s, (k, v) in enumerate(zip(keys, values, strict=True)):
        for b in range(counts[s]):
            block = int(order[used])
            used += 1
            tables[s, b] = block
            part = slice(b * block_size, min((b + 1) * block_size, k.shape[0]))
            cache[0, block, : part.stop - part.start] = k[part]
            cache[1, block, : part.stop - part.start] = v[part]
    return cache, tables


@pytest.mark.parametrize("window,softcap", [(None, None), (1, None), (20, None), (77, 2.0),
                                            (None, 0.5)])  # fmt: skip
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
def test_paged_attention_matches_sdpa(heads, kv_heads, head_dim, window, softcap):
    """Sequences of mixed lengths (a decode token, a chunk, a whole prompt) over a shuffled
    paged cache, against attention on each sequence's own keys with its causal mask (and a
    sliding window: each query sees its last `window` positions; and Gemma 2's soft cap on
    the scores)."""
    gen = torch.Generator().manual_seed(heads * head_dim)
    lengths, new = [1, 37, 600], [1, 5, 600]
    keys = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in lengths]
    values = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in lengths]
    cache, tables = _paged(keys, values, 16, gen)
    q = torch.randn(sum(new), heads, head_dim, generator=gen)
    seq = torch.tensor([s for s, m in enumerate(new) for _ in range(m)], dtype=torch.int32)
    ctx = torch.tensor(
        [n - m + j + 1 for n, m in zip(lengths, new, strict=True) for j in range(m)],
        dtype=torch.int32,
    )
    scale = 1 / math.sqrt(head_dim)
    out = cpu.paged_attention(q, cache, tables, seq, ctx, scale, window, softcap)
    start = 0
    for n, m, k, v in zip(lengths, new, keys, values, strict=True):
        qs = q[start : start + m].transpose(0, 1)[None].double()
        q_pos = torch.arange(n - m, n)[:, None]
        mask = torch.arange(n)[None, :] <= q_pos
        if window is not None:
            mask &= torch.arange(n)[None, :] > q_pos - window
        kh = k.transpose(0, 1).double().repeat_interleave(heads // kv_heads, 0)
        vh = v.transpose(0, 1).double().repeat_interleave(heads // kv_heads, 0)
        scores = qs[0] @ kh.transpose(1, 2) * scale  # [H, m, n]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~mask, float("-inf"))
        ref = (scores.softmax(-1) @ vh).transpose(0, 1)
        assert torch.allclose(out[start : start + m].double(), ref, atol=2e-6, rtol=1e-5)
        start += m


def test_paged_attention_of_a_token_is_the_same_in_any_call():
    """A token's output alone equals it among all the prompt's tokens (bitwise)."""
    gen = torch.Generator().manual_seed(5)
    n = 300
    keys, values = [torch.randn(n, 2, 64, generator=gen)], [torch.randn(n, 2, 64, generator=gen)]
    cache, tables = _paged(keys, values, 16, gen)
    q = torch.randn(n, 6, 64, generator=gen)
    seq = torch.zeros(n, dtype=torch.int32)
    ctx = torch.arange(1, n + 1, dtype=torch.int32)
    whole = cpu.paged_attention(q, cache, tables, seq, ctx, 0.125)
    for t in (0, 17, 255, n - 1):
        one = cpu.paged_attention(q[t : t + 1], cache, tables, seq[:1], ctx[t : t + 1], 0.125)
        assert torch.equal(one[0], whole[t]), t


def test_a_missing_compiler_is_an_os_error(monkeypatch, tmp_path):
    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails
    with pytest.raises(subprocess.CalledProcessError):
        cpu._build()


def test_compute_mode_names_the_products_dtype(monkeypatch):
    cpu_dev = torch.device("cpu")
    assert cpu.compute_mode(cpu_dev, torch.float32, torch.float32, True, 64) == (
        torch.float32, True
    )  # fmt: skip
    assert cpu.compute_mode(cpu_dev, torch.float32, torch.float8_e4m3fn, True, 64)[1] is False
    assert cpu.compute_mode(cpu_dev, torch.bfloat16, torch.bfloat16, True, 64) == (
        torch.bfloat16, False
    )  # fmt: skip
    monkeypatch.setattr(cpu, "available", lambda dtype: False)  # no compiler: torch's kernels
    assert cpu.compute_mode(cpu_dev, torch.float32, torch.float32, True, 64) == (
        torch.bfloat16, False
    )  # fmt: skip
    assert cpu.compute_mode(cpu_dev, torch.float32, torch.float32, False, 64) == (
        torch.float32, False
    )  # fmt: skip


def test_attention_is_ours_only_for_float32_tensors_on_the_cpu():
    """The torch backend is the GPU kernels' oracle too: off the CPU it keeps SDPA."""
    q, cache = torch.zeros(2, 4, 64), torch.zeros(2, 3, 16, 2, 64)
    assert cpu.attention_supported(q, cache)
    assert not cpu.attention_supported(q.to("meta"), cache.to("meta"))
    assert not cpu.attention_supported(q.bfloat16(), cache.bfloat16())
    assert not cpu.attention_supported(q[..., :40], cache[..., :40].contiguous())
