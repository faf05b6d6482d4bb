"""The fused layer kernels (RMSNorm with residual, q/k norm + rotary, SiLU-and-mul) against
the torch layers they replace, run on the CPU in float32 over the same fresh random inputs.

Outputs are poisoned with NaN first, so an element a kernel forgot to write fails. With
OCTAVO_TRITON_INTERPRET=1 a small subset runs on the CPU through Triton's interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("OCTAVO_TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA (or OCTAVO_TRITON_INTERPRET=1)", allow_module_level=True)

from octavo.kernels.activation import gelu_tanh_and_mul, silu_and_mul
from octavo.kernels.rms_norm import rms_norm
from octavo.kernels.rope import qk_norm_rope, qk_norm_rope_store
from octavo.model.layers import RMSNorm, SiluAndMul
from octavo.model.rotary import RotaryEmbedding

pytestmark = pytest.mark.gpu
DEVICE = "cpu" if INTERPRET else "cuda"
# bf16 outputs: the kernels round once, the torch layers after every op.
TOLERANCE = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3, torch.float32: 1e-5}
DTYPES = (
    [torch.bfloat16, torch.float32] if INTERPRET else [torch.bfloat16, torch.float16, torch.float32]
)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    assert not torch.isnan(a).any(), "an output element was never written (NaN poison)"
    return ((a - b).norm() / b.norm()).item()


def rows(n: int) -> list[int]:
    return [1, 7, n] if not INTERPRET else [1, 5]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 1000, 4096] if not INTERPRET else [64, 100])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_torch_layer(dtype, hidden, with_residual):
    for num_rows in rows(300):
        torch.manual_seed(num_rows * hidden)
        x = torch.randn(num_rows, hidden, dtype=dtype) * 3
        residual = torch.randn(num_rows, hidden, dtype=dtype) if with_residual else None
        layer = RMSNorm(hidden, eps=1e-5).to(dtype)
        layer.weight.data.normal_(1, 0.3)
        ref = layer(x.float(), None if residual is None else residual.float())  # CPU, float32
        dev = lambda t: None if t is None else t.to(DEVICE)
        got = rms_norm(dev(x), dev(layer.weight), 1e-5, dev(residual))
        if with_residual:
            assert rel_err(got[1], ref[1]) <= TOLERANCE[dtype] / 4  # a single rounding
            got, ref = got[0], ref[0]
        assert got.shape == x.shape and got.dtype == dtype
        assert rel_err(got, ref) <= TOLERANCE[dtype], (num_rows, hidden)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_in_gemmas_order_rounds_once(dtype):
    """round_first=False: the float32 product with the (float32) weight, rounded once to x's
    dtype (HF's Gemma)."""
    from octavo.model.gemma import GemmaRMSNorm

    torch.manual_seed(3)
    x = torch.randn(300, 1152, dtype=dtype) * 3
    layer = GemmaRMSNorm(1152, eps=1e-6)
    layer.weight.data.normal_(1, 0.5)
    ref = layer(x.float())  # CPU, float32
    got = rms_norm(x.to(DEVICE), layer.weight.data.to(DEVICE), 1e-6, round_first=False)
    assert got.dtype == dtype
    assert rel_err(got, ref) <= TOLERANCE[dtype] / 4


def test_rms_norm_reads_strided_rows():
    x = torch.randn(9, 2 * 128, device=DEVICE)[:, :128]  # rows 256 apart
    w = torch.rand(128, device=DEVICE) + 0.5
    ref = RMSNorm(128)
    ref.weight.data.copy_(w.cpu())
    assert rel_err(rms_norm(x, w, 1e-6), ref(x.cpu())) <= 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128] if not INTERPRET else [64])
@pytest.mark.parametrize("heads", [(16, 8), (32, 8), (4, 4)] if not INTERPRET else [(4, 2)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_qk_norm_rope_matches_the_torch_layers(dtype, head_dim, heads, qk_norm):
    num_heads, num_kv_heads = heads
    rope = RotaryEmbedding(head_dim, 4096, 1_000_000.0)
    for num_tokens in rows(200):
        torch.manual_seed(num_tokens + head_dim)
        width = (num_heads + 2 * num_kv_heads) * head_dim
        qkv = torch.randn(num_tokens, width, dtype=dtype)
        positions = torch.randint(0, 4096, (num_tokens,))
        q_norm, k_norm = RMSNorm(head_dim), RMSNorm(head_dim)
        q_norm.weight.data.normal_(1, 0.3)
        k_norm.weight.data.normal_(1, 0.3)
        q, k, _ = qkv.float().split(
            [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1
        )
        if qk_norm:
            q = q_norm(q.reshape(num_tokens, num_heads, head_dim)).reshape(num_tokens, -1)
            k = k_norm(k.reshape(num_tokens, num_kv_heads, head_dim)).reshape(num_tokens, -1)
        ref_q, ref_k = rope(positions, q, k)
        weights = (
            (q_norm.weight.to(DEVICE, dtype), k_norm.weight.to(DEVICE, dtype))
            if qk_norm
            else (None, None)
        )
        got_q, got_k = qk_norm_rope(
            qkv.to(DEVICE),
            positions.to(DEVICE),
            rope.cos_sin_cache.to(DEVICE),
            num_heads,
            num_kv_heads,
            head_dim,
            *weights,
        )
        assert got_q.shape == (num_tokens, num_heads, head_dim)
        assert got_k.shape == (num_tokens, num_kv_heads, head_dim)
        assert rel_err(got_q.reshape(num_tokens, -1), ref_q) <= TOLERANCE[dtype]
        assert rel_err(got_k.reshape(num_tokens, -1), ref_k) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads", [(16, 8), (32, 8), (12, 3)] if not INTERPRET else [(4, 2), (6, 3)]
)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_qk_norm_rope_store_writes_k_and_v_to_their_slots(dtype, heads, qk_norm):
    """The fused variant returns the same q as `qk_norm_rope` and puts the same k, and v as
    given, into each token's slot of the paged cache; every other slot keeps its data."""
    num_heads, num_kv_heads = heads
    head_dim, block_size, num_blocks = (128 if not INTERPRET else 32), 16, 9
    rope = RotaryEmbedding(head_dim, 4096, 1_000_000.0)
    for num_tokens in rows(100):
        torch.manual_seed(num_tokens + num_heads)
        width = (num_heads + 2 * num_kv_heads) * head_dim
        qkv = torch.randn(num_tokens, width, dtype=dtype, device=DEVICE)
        positions = torch.randint(0, 4096, (num_tokens,), device=DEVICE)
        weights = (None, None)
        if qk_norm:
            weights = tuple(torch.randn(head_dim, device=DEVICE).to(dtype) for _ in range(2))
        cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE)
        cache = cache.to(dtype)
        before = cache.clone()
        slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
        cos_sin = rope.cos_sin_cache.to(DEVICE)
        want_q, want_k = qk_norm_rope(
            qkv, positions, cos_sin, num_heads, num_kv_heads, head_dim, *weights
        )
        got_q = qk_norm_rope_store(
            qkv, positions, cos_sin, num_heads, num_kv_heads, head_dim, cache, slots, *weights
        )
        assert got_q.shape == (num_tokens, num_heads, head_dim)
        assert torch.equal(got_q, want_q)
        flat, old = (
            cache.view(2, -1, num_kv_heads, head_dim),
            before.view(2, -1, num_kv_heads, head_dim),
        )
        assert torch.equal(flat[0, slots], want_k)
        v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, -1)
        assert torch.equal(flat[1, slots], v)
        others = torch.ones(flat.shape[1], dtype=torch.bool, device=DEVICE)
        others[slots] = False
        assert torch.equal(flat[:, others], old[:, others])


def _geglu_reference(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """HF's Gemma MLP: gelu_tanh(gate) rounded to the dtype, times up."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh").to(dtype).float() * up


GATED = {  # kernel, reference on float32 rows of the given dtype
    "silu": (silu_and_mul, lambda x, dtype: SiluAndMul()(x)),
    "gelu_tanh": (gelu_tanh_and_mul, _geglu_reference),
}


@pytest.mark.parametrize("act", list(GATED))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [128, 3072, 6912, 3000] if not INTERPRET else [64, 100])
def test_gated_activations_match_their_torch_references(act, dtype, inter):
    kernel, reference = GATED[act]
    for num_rows in rows(257):
        torch.manual_seed(num_rows + inter)
        x = torch.randn(num_rows, 2 * inter, dtype=dtype) * 3
        got = kernel(x.to(DEVICE))
        assert got.shape == (num_rows, inter) and got.dtype == dtype
        assert rel_err(got, reference(x.float(), dtype)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("heads", [(16, 8), (32, 8), (8, 1)] if not INTERPRET else [(4, 2)])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("fp8", [False, True])
def test_decode_attention_qkv_matches_rope_store_then_decode(heads, qk_norm, num_splits, fp8):
    """Decode straight from the qkv projection gives the output of `qk_norm_rope_store`
    followed by `decode_attention`, and leaves the cache exactly as they do; contexts of one
    token, contexts whose new token opens a split, and a longest-first order included; over a
    bf16 cache and over an e4m3 one with k/v scales."""
    from octavo.kernels.decode_attention import decode_attention, decode_attention_qkv

    num_heads, num_kv_heads = heads
    dtype = torch.bfloat16
    head_dim, block_size = (128 if not INTERPRET else 32), 16
    rope = RotaryEmbedding(head_dim, 4096, 1_000_000.0)
    cos_sin = rope.cos_sin_cache.to(DEVICE)
    seq_lens_list = [1, 17, 64, 65, 300, 129] if not INTERPRET else [1, 17, 33]
    num_seqs = len(seq_lens_list)
    max_blocks = max(-(-n // block_size) for n in seq_lens_list)
    num_blocks = num_seqs * max_blocks + 1
    torch.manual_seed(num_heads + 2 * qk_norm + num_splits)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_seqs, width + 8, dtype=dtype, device=DEVICE)[:, :width]  # strided
    weights = (None, None)
    if qk_norm:
        weights = tuple(torch.randn(head_dim, device=DEVICE).to(dtype) for _ in range(2))
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE)
    cache = cache.to(torch.float8_e4m3fn if fp8 else dtype)
    scales = {"k_scale": 0.5, "v_scale": 2.0} if fp8 else {}
    tables = torch.randperm(num_blocks, device=DEVICE)[: num_seqs * max_blocks].view(num_seqs, -1)
    tables = tables.to(torch.int32).contiguous()
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32, device=DEVICE)
    positions = (seq_lens - 1).to(torch.int64)
    slots = tables.gather(1, (positions // block_size)[:, None].to(torch.int64))[:, 0]
    slots = slots.to(torch.int64) * block_size + positions % block_size
    order = torch.argsort(seq_lens, descending=True, stable=True).to(torch.int32)
    scale = head_dim**-0.5

    want_cache = cache.clone()
    q = qk_norm_rope_store(
        qkv, positions, cos_sin, num_heads, num_kv_heads, head_dim, want_cache, slots, *weights,
        **scales,
    )  # fmt: skip
    want = decode_attention(
        q, want_cache, seq_lens, tables, scale, num_splits, order=order, **scales
    )
    got = decode_attention_qkv(
        qkv, cache, seq_lens, tables, slots, cos_sin, scale, num_heads, *weights,
        order=order, num_splits=num_splits, **scales,
    )  # fmt: skip
    # Every slot but the new k's is exactly as the two-kernel path leaves it. The new k rows
    # may differ by one ulp with the norm on: the two kernels sum squares in other orders.
    new_k = torch.zeros_like(cache, dtype=torch.bool).view(2, -1, num_kv_heads, head_dim)
    new_k[0, slots] = True
    new_k = new_k.view_as(cache)
    assert torch.equal(cache[~new_k], want_cache[~new_k])
    ulp = 2**-3 if fp8 else 2**-7
    torch.testing.assert_close(cache[new_k].float(), want_cache[new_k].float(), rtol=ulp, atol=0)
    if not qk_norm:
        assert torch.equal(cache, want_cache)
    assert got.shape == (num_seqs, num_heads, head_dim)
    # Per sequence: the reference rounds the new token's softmax weight to bf16 in its p @ v,
    # the fused kernel keeps it in fp32; ~5e-4 apart.
    for i in range(num_seqs):
        assert rel_err(got[i], want[i]) <= 3e-3, (i, seq_lens_list[i])
