"""Weight quantization (quant/weights.py): each method's product against a torch
dequantize-then-matmul reference on fresh random inputs, on the CPU kernels and on the
dequantizing paths other devices take; the round trips' error bounds; the ValueErrors."""

from __future__ import annotations

import weakref

import pytest
import torch

import octavo.quant as quant_method
from octavo.kernels import cpu as cpu_kernels
from octavo.model.layers import MergedLinear, RowParallelLinear
from octavo.model.parallel import set_tp
from octavo.quant import cpu_packing, fp8, gguf, rounding, rtn
from octavo.quant import weights as q

# (rows, in features, out features): a decode row, batches on either side of the int8
# kernel's row limit, and in-features with a partial last int4 group (576 = 4.5 x 128, as
# SmolLM2's hidden size) or less than one group (64).
SHAPES = [(1, 256, 96), (7, 576, 960), (65, 576, 64), (3, 64, 32), (130, 1536, 192)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(params=["octavo", "torch", "dequantize"])
def path(request, monkeypatch):
    """Which product runs: octavo's CPU kernel (float32 models), torch's CPU kernels (16-bit
    models: bfloat16 activations), or the dequantize-then-matmul path of other devices."""
    if request.param == "octavo" and not cpu_kernels.available(torch.float32):
        pytest.skip("octavo's CPU kernels could not be built here")
    monkeypatch.setattr(q, "CPU_KERNELS", request.param != "dequantize")
    return request.param


def _dtype(path: str) -> torch.dtype:
    return torch.bfloat16 if path == "torch" else torch.float32


def _tolerance(path: str) -> float:
    # octavo's kernel is float32 throughout (only the sum's order differs); torch's take
    # bfloat16 activations and give bfloat16 outputs (8-bit mantissas): about 2**-9 relative
    # each. A wrong packing order, scale or group is off by O(1).
    return {"octavo": 1e-6, "torch": 1e-2, "dequantize": 1e-5}[path]


@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_int8_matches_dequantized_reference(path, rows, k, n):
    dtype = _dtype(path)
    w, x = torch.randn(n, k, dtype=dtype), torch.randn(rows, k, dtype=dtype)
    weight = q.Int8Weight(w)
    codes, scale = rounding.quantize_int8(w, torch.bfloat16 if path == "torch" else torch.float32)
    ref = x.float() @ rounding.dequantize_int8(codes, scale, torch.float32).T
    y = weight(x)
    assert y.dtype == x.dtype and y.shape == (rows, n)
    assert rel_err(y, ref) < _tolerance(path)


@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_int4_matches_dequantized_reference(path, rows, k, n):
    dtype = _dtype(path)
    w, x = torch.randn(n, k, dtype=dtype), torch.randn(rows, k, dtype=dtype)
    weight = q.Int4Weight(w)
    # The reference quantizes the same way, with the parameters in the dtype the path keeps.
    codes, scale, lo = rounding.quantize_int4(w, q.GROUP_SIZE, dtype)
    ref = x.float() @ rounding.dequantize_int4(codes, scale, lo, k, torch.float32).T
    y = weight(x)
    assert y.dtype == x.dtype and y.shape == (rows, n)
    assert rel_err(y, ref) < _tolerance(path)


@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_fp8_matches_emulated_reference(rows, k, n):
    w, x = torch.randn(n, k), torch.randn(rows, k) * 3
    weight = fp8.Fp8Weight(w)
    xq, x_scale = rounding.quantize_fp8(x)  # per token
    ref = (
        rounding.dequantize_fp8(xq, x_scale, torch.float64)
        @ rounding.dequantize_fp8(weight.qweight, weight.scale, torch.float64).T
    )
    assert rel_err(weight(x), ref) < 1e-5
    assert 1e-3 < rel_err(weight(x), x @ w.T) < 0.1  # activations are quantized too


@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_fp8_blocks_match_emulated_reference(rows, k, n):
    """W8A8 in 128 x 128 weight blocks and 1 x 128 activation groups (partial last blocks
    included) against both dequantized, then a float64 matmul."""
    w = torch.randn(n, k) * torch.logspace(-2, 1, n)[:, None]  # blocks of different scales
    codes, scale = rounding.quantize_fp8_blocks(w, 128, 128)
    weight = fp8.Fp8BlockWeight(codes, scale, torch.float32)
    x = torch.randn(rows, k) * 3
    xq, x_scale = rounding.quantize_fp8_blocks(x, 1, 128)
    ref = (
        rounding.dequantize_fp8_blocks(xq, x_scale, 1, 128, torch.float64)
        @ rounding.dequantize_fp8_blocks(codes, scale, 128, 128, torch.float64).T
    )
    y = weight(x)
    assert y.dtype == x.dtype and y.shape == (rows, n)
    assert rel_err(y, ref) < 1e-5
    assert 1e-3 < rel_err(y, x @ w.T) < 0.1  # activations are quantized too


def test_fp8_block_round_trip_relative_error():
    w = torch.randn(200, 300) * torch.logspace(-3, 1, 200)[:, None]
    w[128:, 256:] = 0  # an all-zero (partial) block stays zero, with no NaN
    codes, scale = rounding.quantize_fp8_blocks(w, 128, 128)
    assert codes.shape == w.shape and scale.shape == (2, 3)
    back = rounding.dequantize_fp8_blocks(codes, scale, 128, 128, torch.float32)
    assert torch.equal(back[128:, 256:], torch.zeros(72, 44))
    per_element = scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    big = w.abs() > per_element * 2**-6  # e4m3's normal range: 3 mantissa bits
    assert ((back - w).abs()[big] <= w.abs()[big] * 2**-4).all()
    for i, j in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]:  # each block at e4m3's max
        block = codes[128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)].float().abs()
        assert block.max() == (0 if (i, j) == (1, 2) else 448), (i, j)


@pytest.mark.parametrize("seed", range(4))
def test_int8_round_trip_within_half_a_step(seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 300, generator=gen) * torch.logspace(-3, 1, 64)[:, None]  # any scale
    codes, scale = rounding.quantize_int8(w, torch.float32)
    assert codes.dtype == torch.int8 and codes.abs().max() == 127
    err = (rounding.dequantize_int8(codes, scale, torch.float32) - w).abs()
    # half a step, plus float32's rounding of the product and the difference (a few ulps of w)
    assert (err <= scale[:, None] / 2 + w.abs() * 2**-21).all()


def test_int4_round_trip_within_half_a_step_per_group():
    w = torch.randn(16, 192)  # groups of 128 and of 64 (the last, partial)
    w[:, 128:] = 5 + torch.rand(16, 64)  # far from 0: padding must not widen its range
    codes, scale, lo = rounding.quantize_int4(w, 128, torch.float32)
    assert codes.shape == (16, 256) and scale.shape == lo.shape == (16, 2)
    assert 0 <= codes.min() and codes.max() <= 15
    back = rounding.dequantize_int4(codes, scale, lo, 192, torch.float32)
    assert back.shape == w.shape
    step = scale.repeat_interleave(128, dim=1)[:, :192]
    assert ((back - w).abs() <= step / 2 * (1 + 1e-5)).all()
    assert (scale[:, 1] < 1 / 15 + 1e-6).all()  # the partial group's range is its own


def test_int4_keeps_a_checkpoints_codes_on_its_grid(path):
    """A checkpoint's own codes on its grid (w = q * d + m in blocks of 32, as GGUF's Q4_1 or
    AWQ's) are kept as they are: the product equals the grid's own float product, and the
    weight passed beside them is not read (a meta tensor)."""
    n, k = 48, 96
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    d, m = torch.rand(n, k // 32) * 0.05 + 1e-3, torch.randn(n, k // 32) * 0.1
    w = codes * d.repeat_interleave(32, 1) + m.repeat_interleave(32, 1)
    meta = torch.empty(n, k, device="meta", dtype=_dtype(path))
    layer = q.Int4Weight(meta, 32, grid=(d, m), codes=codes)
    assert layer.cpu_kernel == q.CPU_KERNELS
    x = torch.randn(5, k)
    assert rel_err(layer(x.to(meta.dtype)), x @ w.t()) < _tolerance(path) + 4e-3 * (path == "torch")


@pytest.mark.parametrize("rows", [1, 9])
def test_q8_weight_matches_its_dequantized_blocks(path, rows):
    """8-bit codes with a scale and minimum per 32 columns against codes x scales + minimums,
    then a matmul: GGUF Q8_0 groups (int8 + 128, minimum -128 d; the extreme codes included)
    beside 4-bit groups (Q4_1's: codes below 16, any minimum) in the same rows."""
    codes = torch.randint(-128, 128, (208, 96), dtype=torch.int8)
    codes[0, :2] = torch.tensor([-128, 127], dtype=torch.int8)
    u = codes.view(torch.uint8) ^ 0x80
    scale = torch.rand(208, 3) * 0.01 + 1e-4
    lo = -128 * scale
    u[:, 64:] &= 15  # the last group of each row: 4-bit codes with a minimum of its own
    lo[:, 2] = torch.randn(208) * 0.05
    weight = u.float() * scale.repeat_interleave(32, dim=1) + lo.repeat_interleave(32, dim=1)
    layer = gguf.Q8Weight(u, scale, lo, _dtype(path))
    x = torch.randn(rows, 96)
    assert rel_err(layer(x.to(_dtype(path))), x @ weight.t()) < _tolerance(path)
    if path == "torch":  # the planes' weights, as the kernel forms them: (h - 8) 16 s + zero, ...
        planes = [layer.high_scale_zero.float(), layer.low_scale_zero.float()]
        parts = [(u >> 4).float(), (u & 15).float()]
        w = sum(
            (p.view(208, 3, 32) - 8) * sz[..., 0].t()[..., None] + sz[..., 1].t()[..., None]
            for p, sz in zip(parts, planes, strict=True)
        ).view(208, 96)
        s16, m16 = scale.bfloat16().float(), lo.bfloat16().float()
        want = u.float().view(208, 3, 32) * s16[..., None] + m16[..., None]
        # Q8_0 groups exactly; a 4-bit group as Int4Weight's, its minimum in the low plane's
        # zero, rounded to bfloat16 once (in the high plane it would be off by 128 s's
        # rounding), unless that minimum is -128 s, as a Q8_0 group's: exact then.
        assert torch.equal(w.view(208, 3, 32)[:, :2], want[:, :2])
        zero = (m16[:, 2] + 8 * s16[:, 2]).bfloat16().float()
        low = (u.float().view(208, 3, 32)[:, 2] - 8) * s16[:, 2, None] + zero[:, None]
        as_q8_0 = (m16[:, 2] == -128 * s16[:, 2])[:, None]
        assert torch.equal(w.view(208, 3, 32)[:, 2], torch.where(as_q8_0, want[:, 2], low))


@pytest.mark.parametrize("n,k", [(128, 96), (960, 576), (48, 64), (4096 * 2 + 96, 64)])
def test_int4_packing_gives_torchs_bytes(n, k):
    """The CPU kernel's weights (and a Q8 head's two planes, packed in runs of rows) come
    from uint8 codes in octavo's copy of torch's packed layout, found at first use (blocks of
    64 rows with AVX-512, 32 with AVX2): the bytes of torch's own op on int32 codes, a
    partial last block included."""
    if not q.CPU_KERNELS:
        pytest.skip("this torch has no CPU int4 kernel")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX512", "AVX2"):
        assert cpu_packing.int4pack_block_rows() == {"AVX512": 64, "AVX2": 32}[capability]
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    want = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    assert torch.equal(cpu_packing.int4pack(codes), want)
    u = torch.randint(0, 256, (n, k), dtype=torch.uint8)
    high, low = cpu_packing.q8_planes(u)
    u = u.to(torch.int32)
    assert torch.equal(high, torch._convert_weight_to_int4pack_for_cpu(u >> 4, 1))
    assert torch.equal(low, torch._convert_weight_to_int4pack_for_cpu(u & 15, 1))


def test_fp8_round_trip_relative_error():
    w = torch.randn(32, 128)
    w[3] = 0  # an all-zero row stays zero, with no NaN
    codes, scale = rounding.quantize_fp8(w)
    back = rounding.dequantize_fp8(codes, scale, torch.float32)
    assert torch.equal(back[3], torch.zeros(128))
    big = w.abs() > scale[:, None] * 2**-6  # e4m3's normal range: 3 mantissa bits
    assert ((back - w).abs()[big] <= w.abs()[big] * 2**-4).all()


def test_linear_quantize_keeps_bias_and_counts_the_quantized_weight():
    linear = RowParallelLinear(256, 96, bias=True)
    with torch.no_grad():
        linear.weight.normal_()
        linear.bias.normal_()
    w, x = linear.weight.detach().clone(), torch.randn(5, 256)
    rtn.quantize(linear, "int8")
    assert linear.weight is None
    octavo = linear.quant.packed is not None  # its scales sit in the codes' blocks
    assert {name for name, _ in linear.named_parameters()} == {
        "bias", "quant.qweight", *(() if octavo else ("quant.scale",))
    }  # fmt: skip
    codes, scale = rounding.quantize_int8(w, torch.float32 if octavo else torch.bfloat16)
    ref = x @ rounding.dequantize_int8(codes, scale, torch.float32).T
    assert rel_err(linear(x), ref + linear.bias) < 1e-2
    assert rel_err(linear(x), x @ w.T + linear.bias) < 2e-2


def test_each_rank_quantizes_its_own_shard():
    """Tensor parallelism: a rank quantizes the shard it loaded; its product is that shard's."""
    full = torch.randn(2 * 192, 576)  # gate and up, 192 rows each
    x = torch.randn(3, 576)
    try:
        outputs = []
        for rank in range(2):
            set_tp(rank, 2, None)
            merged = MergedLinear(576, [192, 192])
            merged.weight_loader(merged.weight, full[:192], 0)
            merged.weight_loader(merged.weight, full[192:], 1)
            rtn.quantize(merged, "int4")
            outputs.append(merged(x))  # [3, 96 gate + 96 up]
    finally:
        set_tp(0, 1, None)
    gate = torch.cat([o[:, :96] for o in outputs], dim=1)
    up = torch.cat([o[:, 96:] for o in outputs], dim=1)
    assert rel_err(torch.cat([gate, up], dim=1), x @ full.T) < 0.15  # int4's own error


def test_unknown_method_is_a_value_error():
    with pytest.raises(ValueError, match="quantization must be None or one of"):
        quant_method.get_method("nf4", torch.device("cpu"))
    with pytest.raises(ValueError, match="quantization"):
        rtn.quantize_weight("awq", torch.randn(4, 4))
    with pytest.raises(ValueError, match="quantization"):
        rtn.quantize_weight("gguf", torch.randn(4, 4))  # only a GGUF file's own blocks
    quant_method.get_method(None, torch.device("cpu"))
    for method in quant_method.METHODS:
        if method in ("awq", "gptq"):  # a checkpoint of theirs only
            with pytest.raises(ValueError, match="has no quantization_config"):
                quant_method.get_method(method, torch.device("cpu"))
        else:
            assert quant_method.get_method(method, torch.device("cpu")).name == method


def test_build_engine_refuses_an_unknown_method_before_loading():
    from octavo.engine.builder import build_engine

    with pytest.raises(ValueError, match="quantization must be None or one of"):
        build_engine("qwen3-0.6b", load_format="dummy", quantization="nf4")


def test_gguf_needs_a_gguf_file():
    from octavo.engine.builder import build_engine

    with pytest.raises(ValueError, match="quantization='gguf'.*needs a .gguf model file"):
        build_engine("qwen3-0.6b", load_format="dummy", quantization="gguf")


def test_fp8_needs_a_gpu_with_fp8(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="quantization='fp8' needs a GPU with FP8"):
        quant_method.get_method("fp8", cuda)
    quant_method.get_method("int8", cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    quant_method.get_method("fp8", cuda)


def test_warm_up_runs_quantized_projections_on_float_inputs():
    from torch import nn

    from octavo.model.layers import Linear
    from octavo.runner.kv_setup import warm_up_linears, warm_up_rows

    quantized, plain = Linear(256, 64), Linear(256, 64)
    for linear in (quantized, plain):
        nn.init.normal_(linear.weight)
    rtn.quantize(quantized, "int4")
    launched = warm_up_linears(nn.ModuleList([quantized, plain]), 9)
    assert launched == 2 * len(warm_up_rows(9))


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_float_weights_quantized_on_load_are_made_one_linear_at_a_time(
    smollm2_path, method, monkeypatch
):
    """quantization="int8"/"int4" on a float checkpoint (the embedded GGUF read as float):
    each Linear quantizes while it is the only one holding a float weight (the others hold
    their quantized weight, or a meta one not loaded yet), and the model equals the float
    model with each Linear quantized after the load."""
    from octavo.checkpoint.hf_config import load_hf_config
    from octavo.checkpoint.loader import load_model
    from octavo.model.layers import Linear

    weights, alive = [], []  # each float weight quantized; how many earlier ones live then
    quantize_weight = rtn.quantize_weight

    def spy(name: str, weight: torch.Tensor):
        alive.append(sum(ref() is not None for ref in weights))
        weights.append(weakref.ref(weight))
        return quantize_weight(name, weight)

    config, cpu = load_hf_config(smollm2_path), torch.device("cpu")
    monkeypatch.setattr(rtn, "quantize_weight", spy)
    model = load_model(smollm2_path, config, torch.float32, cpu, quantization=method)
    assert alive == [0] * len(weights) and len(weights) == 4 * config.num_hidden_layers
    assert all(m.weight is None for m in model.modules() if isinstance(m, Linear))
    monkeypatch.undo()
    reference = load_model(smollm2_path, config, torch.float32, cpu)
    for m in reference.modules():
        if isinstance(m, Linear):
            rtn.quantize(m, method)
    expected = dict(reference.state_dict())
    assert expected.keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def _rtn_shards(path: str, ranks: int, method: str | None) -> list:
    """Each rank's model of the float checkpoint at `path`, loaded with quantization=method."""
    from octavo.checkpoint.hf_config import load_hf_config
    from octavo.checkpoint.loader import load_model

    try:
        models = []
        for rank in range(ranks):
            set_tp(rank, ranks, None)
            config = load_hf_config(path)
            models.append(
                load_model(path, config, torch.float32, torch.device("cpu"), quantization=method)
            )
        return models
    finally:
        set_tp(0, 1, None)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_each_rank_quantizes_its_shards_as_they_land(tmp_path, method):
    """Two ranks of a Qwen2 float checkpoint (q/k/v biases) quantized on load: each equals
    that rank's float model with each Linear quantized after its load, bit for bit."""
    from int4_checkpoints import write_checkpoint

    from octavo.model.layers import Linear

    _, float_path, _ = write_checkpoint("qwen2", tmp_path, "awq", group_size=32)
    for model, reference in zip(
        _rtn_shards(float_path, 2, method), _rtn_shards(float_path, 2, None)
    ):
        for m in reference.modules():
            if isinstance(m, Linear):
                rtn.quantize(m, method)
        expected = reference.state_dict()
        assert expected.keys() == model.state_dict().keys()
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, expected[name]), name


def test_a_tensor_stored_twice_is_a_value_error(tmp_path):
    """A projection's tensor in two weight files: quantizing on load names it, rather than
    quantizing a Linear whose other fused parts never reached its second scratch."""
    from int4_checkpoints import write_checkpoint
    from safetensors.torch import load_file, save_file

    _, float_path, _ = write_checkpoint("llama", tmp_path, "awq", group_size=32)
    name = "model.layers.0.self_attn.q_proj.weight"
    tensor = load_file(f"{float_path}/model.safetensors")[name]
    save_file({name: tensor}, f"{float_path}/model_extra.safetensors")  # read after the first
    with pytest.raises(ValueError, match="layers.0.self_attn.qkv_proj twice"):
        _rtn_shards(float_path, 1, "int8")
