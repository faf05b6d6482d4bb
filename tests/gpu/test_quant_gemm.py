"""The weight-only quantized GEMMs (kernels/quant_gemm.py) against the torch reference,
dequantize_int4 / dequantize_int8 + a matmul, on fresh random inputs: every kernel (GEMV,
tile GEMM, dequantize + F.linear), with and without split-K, at many row counts, shapes,
group sizes and both 16-bit dtypes; Int4Weight and Int8Weight end to end, eagerly and
replayed from a CUDA graph.

Two kinds of check. On an exact grid (power-of-two scales, integer minimums and activations)
every kernel's float32 sum is exact, so its output must equal the exact product rounded once
to the dtype, bit for bit: a misplaced code, group or mask cannot hide in a tolerance. On
random weights quantized by quantize_int4 / quantize_int8 the error against the exact
product must stay within twice that of the torch reference computed in the same dtype.
With OCTAVO_TRITON_INTERPRET=1 a small subset runs on the CPU through Triton's interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
INTERPRET = os.environ.get("OCTAVO_TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA (or OCTAVO_TRITON_INTERPRET=1)", allow_module_level=True)

from octavo.kernels import quant_gemm as qg
from octavo.quant import fp8, rounding
from octavo.quant import weights as q

pytestmark = pytest.mark.gpu
DEVICE = "cpu" if INTERPRET else "cuda"
DTYPES = [torch.bfloat16] if INTERPRET else [torch.bfloat16, torch.float16]
ROWS = [1, 3, 16] if INTERPRET else [1, 3, 16, 64, 257]
cuda_only = pytest.mark.skipif(INTERPRET, reason="needs CUDA")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(DEVICE).manual_seed(seed)


def exact_int4(n: int, k: int, group: int, seed: int):
    """(codes [N, Kp], scale, min [N, G], float64 weight [N, K]) with w = (q + c) s, s a power
    of two and c an integer: the weight and every partial sum against integer activations
    are exact in float32 and in the dtype."""
    g = _gen(seed)
    groups = -(-k // group)
    codes = torch.randint(0, 16, (n, groups * group), generator=g, device=DEVICE)
    scale = 2.0 ** torch.randint(-2, 0, (n, groups), generator=g, device=DEVICE).double()
    lo = -torch.randint(0, 16, (n, groups), generator=g, device=DEVICE).double() * scale
    w = rounding.dequantize_int4(codes, scale, lo, k, torch.float64)
    return codes.to(torch.uint8), scale, lo, w


def exact_int8(n: int, k: int, seed: int):
    """(codes int8 [N, K], scale [N], float64 weight) with power-of-two scales."""
    g = _gen(seed)
    codes = torch.randint(-127, 128, (n, k), generator=g, device=DEVICE).to(torch.int8)
    scale = 2.0 ** torch.randint(-3, -1, (n,), generator=g, device=DEVICE).double()
    return codes, scale, codes.double() * scale[:, None]


def exact_fp8(n: int, k: int, seed: int):
    """(e4m3 codes [N, K], float32 scale [N], float64 weight) with power-of-two scales and
    every code whose magnitude is below 16, subnormals and both zeros included: sums of K
    such codes against -1, 0, 1 are exact in float32."""
    g = _gen(seed)
    byte = torch.randint(0, 256, (n, k), generator=g, device=DEVICE).to(torch.uint8)
    byte = byte & 0xDF  # exponent field at most 10 (below 2**4), so never NaN
    codes = byte.view(torch.float8_e4m3fn)
    scale = 2.0 ** torch.randint(-3, 2, (n,), generator=g, device=DEVICE).float()
    return codes, scale, codes.double() * scale.double()[:, None]


def integer_x(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randint(-1, 2, (m, k), generator=_gen(seed), device=DEVICE).to(dtype)


def configs(m: int, bits: int, group: int) -> list[qg.Plan]:
    """Every kernel at `m` rows, split-K on and off (the GEMV only at one row)."""
    block_k = max(128, group)
    block_m = min(max(16, 1 << (m - 1).bit_length()), 128)
    wide_warps = 8 if block_m == 128 else 4
    out = [qg.Plan("gemm", block_m, 64, block_k, s, 4, 3) for s in (1, 4)]
    out += [qg.Plan("gemm", block_m, 128, block_k, s, wide_warps, 4) for s in (1, 2)]
    if m > 32 or INTERPRET:
        out.append(qg.Plan("gemm", 256, 128, block_k, 1, 8, 2))
    out.append(qg.Plan("dequant", m, 32, block_k, 1, 4, 1))
    if m == 1:
        out += [qg.Plan("gemv", 1, 32, max(2048 // bits, group), s, 4, 3) for s in (1, 2)]
        out += [qg.Plan("gemv", 1, 128, max(512 // bits, group), s, 4, 2) for s in (1, 4)]
    return out


def _name(p: qg.Plan) -> str:
    return f"{p.kernel}-m{p.block_m}-n{p.block_n}-s{p.splits}"


# --- exact grids: every kernel, bit for bit -------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [32, 128] if INTERPRET else [32, 64, 128])
@pytest.mark.parametrize("m", [1, 5] if INTERPRET else [1, 5, 33, 100])
def test_int4_kernels_are_exact_on_an_exact_grid(m, group, dtype):
    n, k = (256, 512) if INTERPRET else (384, 1024)
    codes, scale, lo, w = exact_int4(n, k, group, seed=m + group)
    words = qg.pack_int4(codes, group)
    x = integer_x(m, k, dtype, seed=m)
    ref = (x.double() @ w.T).to(dtype)
    for p in configs(m, 4, group):
        if p.kernel == "dequant" and not INTERPRET:
            continue  # cuBLAS may reduce in 16 bits; its weight is checked exactly below
        y = qg.int4_linear(x, words, scale.to(dtype), lo.to(dtype), group, config=p)
        assert y.dtype == dtype and torch.equal(y, ref), _name(p)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5] if INTERPRET else [1, 5, 33, 100])
def test_int8_kernels_are_exact_on_an_exact_grid(m, dtype):
    n, k = (256, 512) if INTERPRET else (384, 1024)
    codes, scale, w = exact_int8(n, k, seed=m)
    words = qg.pack_int8(codes)
    x = integer_x(m, k, dtype, seed=m)
    ref = (x.double() @ w.T).to(dtype)
    for p in configs(m, 8, qg.INT8_BLOCK):
        if p.kernel == "dequant" and not INTERPRET:
            continue
        y = qg.int8_linear(x, words, scale.to(dtype), config=p)
        assert y.dtype == dtype and torch.equal(y, ref), _name(p)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nk", [(256, 512), (136, 200)])
def test_fp8_gemv_is_exact_on_an_exact_grid(nk, dtype):
    """Every e4m3 code below 16 reads as its value, in the plain layout, split or not, with N
    off the tile size and K ending inside an iteration."""
    n, k = nk
    codes, scale, w = exact_fp8(n, k, seed=n)
    x = integer_x(1, k, dtype, seed=k)
    ref = (x.double() @ w.T).to(dtype)
    for p in [qg.Plan("gemv", 1, 32, 256, s, 4, 3) for s in (1, 2)] + [None]:
        y = qg.fp8_gemv(x, codes, scale, config=p)
        assert y.dtype == dtype and torch.equal(y, ref), p
    assert torch.equal(qg.fp8_gemv(x[0], codes, scale), ref[0])  # a 1-D row


@pytest.mark.parametrize("nk", [(256, 512), (200, 328)])
def test_fp8_gemv_reads_a_scale_per_block(nk):
    """HF fp8 checkpoints' layout: a scale per 128 x 128 block, N and K ending inside one."""
    n, k = nk
    codes, _, _ = exact_fp8(n, k, seed=k)
    blocks = (-(-n // 128), -(-k // 128))
    scale = 2.0 ** torch.randint(-1, 2, blocks, generator=_gen(n), device=DEVICE).float()
    per_element = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    w = codes.double() * per_element.double()
    x = integer_x(1, k, torch.bfloat16, seed=n)
    ref = (x.double() @ w.T).bfloat16()
    for p in [qg.Plan("gemv", 1, 32, 256, s, 4, 3) for s in (1, 2)] + [None]:
        assert torch.equal(qg.fp8_gemv(x, codes, scale, block_size=128, config=p), ref), p


def test_fp8_gemv_refuses_what_it_cannot_read():
    codes, scale, _ = exact_fp8(64, 256, seed=1)
    x = integer_x(2, 256, torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match="one row"):
        qg.fp8_gemv(x, codes, scale)
    with pytest.raises(ValueError, match="K in 4s"):
        qg.fp8_gemv(x[:1, :254], codes[:, :254].contiguous(), scale)
    with pytest.raises(ValueError, match="float32 scales"):
        qg.fp8_gemv(x[:1], codes, scale.bfloat16())
    with pytest.raises(ValueError, match="in blocks of 128"):
        qg.fp8_gemv(x[:1], codes, scale, block_size=128)  # a scale per row, not per block
    with pytest.raises(ValueError, match="in blocks of 96"):
        qg.fp8_gemv(x[:1], codes, torch.ones(1, 3, device=DEVICE), block_size=96)


@pytest.mark.parametrize("group", [32, 128])
def test_dequantize_kernel_writes_the_reference_weight(group):
    """The large-M path's weight equals dequantize_int4 / dequantize_int8 (exact grids: both
    round once), including a K that ends inside a group and inside an int8 block."""
    n, k = 160, 3 * group + 40
    codes, scale, lo, w = exact_int4(n, k, group, seed=group)
    p = qg.plan(qg.DEQUANT_MIN_ROWS, n, codes.shape[1], 4, group, 132)
    words = qg.pack_int4(codes, group)
    got = qg._dequantize(words, scale.bfloat16(), lo.bfloat16(), 4, group, k, torch.bfloat16, p)
    assert torch.equal(got, w.bfloat16())
    codes8, scale8, w8 = exact_int8(n, k, seed=group)
    p8 = qg.plan(qg.DEQUANT_MIN_ROWS, n, k, 8, qg.INT8_BLOCK, 132)
    words8 = qg.pack_int8(codes8)
    got8 = qg._dequantize(words8, scale8.bfloat16(), scale8, 8, qg.INT8_BLOCK, k,
                          torch.bfloat16, p8)  # fmt: skip
    assert torch.equal(got8, w8.bfloat16())


@pytest.mark.parametrize("shape", [(1, 264, 576, 128), (7, 264, 576, 64), (1, 136, 200, 32)])
def test_partial_tiles_and_groups_are_masked(shape):
    """N off the tile size (a multiple of 8), K ending inside a group (Int4Weight pads it to
    whole groups, the activations stop at K), strided rows of x: exact as ever."""
    m, n, k, group = shape
    codes, scale, lo, w = exact_int4(n, k, group, seed=n + k)
    words = qg.pack_int4(codes, group)
    x = integer_x(m, 2 * k, torch.bfloat16, seed=k)[:, :k]  # rows 2k apart
    ref = (x.double() @ w.T).bfloat16()
    for p in configs(m, 4, group):
        y = qg.int4_linear(x, words, scale.bfloat16(), lo.bfloat16(), group, config=p)
        if p.kernel != "dequant" or INTERPRET:
            assert torch.equal(y, ref), _name(p)
    codes8, scale8, w8 = exact_int8(n, k, seed=k)
    y8 = qg.int8_linear(x, qg.pack_int8(codes8), scale8.bfloat16())
    assert torch.equal(y8, (x.double() @ w8.T).bfloat16())


def test_split_k_leaves_its_counters_at_zero():
    """The last program of each tile resets its counter, so the next launch starts clean."""
    codes, scale, lo, w = exact_int4(256, 512, 128, seed=3)
    words = qg.pack_int4(codes, 128)
    x = integer_x(1, 512, torch.bfloat16, seed=3)
    for p in [qg.Plan("gemv", 1, 32, 128, 4, 4, 3), qg.Plan("gemm", 16, 64, 128, 4, 4, 3)]:
        for _ in range(3):
            y = qg.int4_linear(x, words, scale.bfloat16(), lo.bfloat16(), 128, config=p)
            assert torch.equal(y, (x.double() @ w.T).bfloat16())
        assert not qg._counters[x.device].any()


# --- random weights: the default plan against the torch reference -------------------------


def _check_against_reference(y, x, w_ref_dtype, w_exact):
    """y's error against the exact product is at most twice that of F.linear on the
    reference's dequantized weight in x's dtype."""
    exact = x.double() @ w_exact.T
    torch_ref = F.linear(x, w_ref_dtype) if not INTERPRET else (x.float() @ w_ref_dtype.float().T)
    ref_err = rel_err(torch_ref.to(x.dtype), exact)
    assert y.shape == exact.shape and y.dtype == x.dtype
    assert rel_err(y, exact) <= 2 * ref_err, (rel_err(y, exact), ref_err)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [32, 128] if INTERPRET else [32, 64, 128])
@pytest.mark.parametrize(
    "nk", [(256, 512)] if INTERPRET else [(4096, 4096), (1536, 12288), (24576, 1024)]
)
def test_int4_matches_the_dequantized_reference(nk, group, dtype):
    n, k = nk
    g = _gen(n + k + group)
    weight = torch.randn(n, k, generator=g, device=DEVICE) * 0.02
    codes, scale, lo = rounding.quantize_int4(weight, group, dtype)
    words = qg.pack_int4(codes, group)
    w_exact = rounding.dequantize_int4(codes, scale, lo, k, torch.float64)
    w_dtype = rounding.dequantize_int4(codes, scale, lo, k, dtype)
    for m in ROWS:
        x = torch.randn(m, k, generator=g, device=DEVICE).to(dtype)
        _check_against_reference(qg.int4_linear(x, words, scale, lo, group), x, w_dtype, w_exact)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "nk", [(256, 512)] if INTERPRET else [(4096, 4096), (1536, 12288), (24576, 1000)]
)
def test_int8_matches_the_dequantized_reference(nk, dtype):
    n, k = nk
    g = _gen(n + k)
    weight = torch.randn(n, k, generator=g, device=DEVICE) * 0.02
    codes, scale = rounding.quantize_int8(weight, dtype)
    words = qg.pack_int8(codes)
    w_exact = rounding.dequantize_int8(codes, scale, torch.float64)
    w_dtype = rounding.dequantize_int8(codes, scale, dtype)
    for m in ROWS:
        x = torch.randn(m, k, generator=g, device=DEVICE).to(dtype)
        _check_against_reference(qg.int8_linear(x, words, scale), x, w_dtype, w_exact)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "nk", [(256, 512)] if INTERPRET else [(4096, 4096), (1536, 12288), (24576, 1000)]
)
def test_fp8_gemv_matches_the_dequantized_reference(nk, dtype):
    n, k = nk
    g = _gen(n + k + 8)
    weight = torch.randn(n, k, generator=g, device=DEVICE) * 0.02
    codes, scale = rounding.quantize_fp8(weight)
    w_exact = rounding.dequantize_fp8(codes, scale, torch.float64)
    w_dtype = rounding.dequantize_fp8(codes, scale, dtype)
    x = torch.randn(1, k, generator=g, device=DEVICE).to(dtype)
    _check_against_reference(qg.fp8_gemv(x, codes, scale), x, w_dtype, w_exact)


# --- the plan --------------------------------------------------------------------------------


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)])
@pytest.mark.parametrize("bits,group", [(4, 128), (4, 32), (8, qg.INT8_BLOCK)])
def test_plan_fills_the_gpu_at_decode_sizes(n, k, bits, group):
    """At one row and at 16, tiles x splits reach the target unless K has no iterations left
    to split; splits are powers of two within the counters; prefill sizes dequantize."""
    sms = 132
    for m, kernel, target, min_iters in [(1, "gemv", 4 * sms, 2), (16, "gemm", 2 * sms, 4)]:
        p = qg.plan(m, n, k, bits, group, sms)
        tiles = -(-n // p.block_n)
        iters = -(-k // p.block_k)
        assert p.kernel == kernel and p.splits & (p.splits - 1) == 0 and tiles <= qg.COUNTERS
        assert iters >= p.splits * min_iters  # each split keeps whole iterations to pipeline
        full = tiles * p.splits >= target or p.splits == qg.MAX_SPLITS
        assert full or iters < 2 * p.splits * min_iters
    assert qg.plan(257, n, k, bits, group, sms).splits == 1
    assert qg.plan(qg.DEQUANT_MIN_ROWS, n, k, bits, group, sms).kernel == "dequant"


# --- Int4Weight and Int8Weight on CUDA ----------------------------------------------------------


@cuda_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "method,group", [("int4", 128), ("int4", 32), ("int4", 256), ("int8", None)]
)
def test_quantized_weights_run_the_kernels_eagerly_and_in_graphs(method, group, dtype):
    """On CUDA the layers run the kernels (no dequantized copy of the weight), at every row
    count, with 3-D inputs, and replayed from a CUDA graph over new activations."""
    n, k = 2048, 1536
    g = _gen(7)
    weight = (torch.randn(n, k, generator=g, device="cuda") * 0.02).to(dtype)
    if method == "int4":
        layer = q.Int4Weight(weight, group)
        codes, scale, lo = rounding.quantize_int4(weight, group, dtype)
        w_exact = rounding.dequantize_int4(codes, scale, lo, k, torch.float64)
        w_dtype = rounding.dequantize_int4(codes, scale, lo, k, dtype)
    else:
        layer = q.Int8Weight(weight)
        codes, scale = rounding.quantize_int8(weight, dtype)
        w_exact = rounding.dequantize_int8(codes, scale, torch.float64)
        w_dtype = rounding.dequantize_int8(codes, scale, dtype)
    assert layer.gpu_kernel and layer.qweight.dtype == torch.int32
    for m in [1, 2, 16, 64, 257, 1500]:
        x = torch.randn(m, k, generator=g, device="cuda").to(dtype)
        _check_against_reference(layer(x), x, w_dtype, w_exact)
    x3 = torch.randn(2, 3, k, generator=g, device="cuda").to(dtype)
    y3 = layer(x3)
    assert y3.shape == (2, 3, n)
    _check_against_reference(y3.view(6, n), x3.view(6, k), w_dtype, w_exact)
    for m in [1, 8]:  # split-K GEMV and GEMM
        x = torch.randn(m, k, generator=g, device="cuda").to(dtype)
        layer(x)  # compiled outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = layer(x)
        for _ in range(3):
            x.copy_(torch.randn(m, k, generator=g, device="cuda"))
            graph.replay()
            torch.cuda.synchronize()
            _check_against_reference(y, x, w_dtype, w_exact)


@cuda_only
def test_fp8_weight_runs_the_gemv_at_one_row_eagerly_and_in_graphs():
    """Fp8Weight on Hopper: one row through the GEMV, which keeps x in 16 bits, so its error
    is that of the dequantized weight (the scaled matmul's, with x in e4m3 too, is ~15 times
    larger); replayed from a CUDA graph over new activations."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._scaled_mm's fp8 path needs Hopper")
    n, k = 2048, 1536
    g = _gen(9)
    layer = fp8.Fp8Weight((torch.randn(n, k, generator=g, device="cuda") * 0.02).bfloat16())
    assert layer.scaled_mm
    w_exact = rounding.dequantize_fp8(layer.qweight, layer.scale, torch.float64)
    w_dtype = rounding.dequantize_fp8(layer.qweight, layer.scale, torch.bfloat16)
    x = torch.randn(1, k, generator=g, device="cuda").bfloat16()
    _check_against_reference(layer(x), x, w_dtype, w_exact)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(x)
    for _ in range(3):
        x.copy_(torch.randn(1, k, generator=g, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        _check_against_reference(y, x, w_dtype, w_exact)


@cuda_only
def test_float32_weights_keep_the_dequantizing_path():
    weight = torch.randn(256, 512, device="cuda")
    layer = q.Int4Weight(weight)
    assert not layer.gpu_kernel and layer.qweight.dtype == torch.uint8
    x = torch.randn(3, 512, device="cuda")
    codes, scale, lo = rounding.quantize_int4(weight, q.GROUP_SIZE, torch.float32)
    ref = x @ rounding.dequantize_int4(codes, scale, lo, 512, torch.float32).T
    assert rel_err(layer(x), ref) < 1e-5
