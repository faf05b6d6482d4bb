"""AWQ and GPTQ checkpoints (quant/awq_gptq.py): tiny random models written in each
format's own layout by a reference quantizer (tests/int4_checkpoints.py), then loaded by
octavo. Every projection must hold exactly the reference dequantization, and the model must
give HF's greedy tokens on those dequantized weights; the options that do not fit raise
ValueError."""

from __future__ import annotations

import json

import pytest
import torch
from int4_checkpoints import AWQ_ORDER, write_checkpoint
from model_utils import PagedRunner, eos_ids, hf_greedy, hf_logits, rel_err
from safetensors.torch import load_file, save_file

from octavo import LLM, SamplingParams
from octavo.checkpoint.hf_config import load_hf_config
from octavo.checkpoint.loader import load_model
from octavo.model.layers import Linear
from octavo.model.parallel import set_tp
from octavo.quant import rtn
from octavo.quant import weights as quantization
from octavo.quant.awq_gptq import _unpack

CPU = torch.device("cpu")


def _load(path: str, **kwargs):
    return load_model(path, load_hf_config(path), torch.float32, CPU, **kwargs)


def _linears(model) -> dict[str, Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear)}


def assert_exact_dequantization(quantized, reference):
    """Every projection is an Int4Weight whose product with the identity (the dequantized
    weight, on the dequantizing path) equals the reference's float weight bit for bit."""
    plain = _linears(reference)
    for name, module in _linears(quantized).items():
        assert module.weight is None and isinstance(module.quant, quantization.Int4Weight)
        eye = torch.eye(module.quant.in_features)
        assert torch.equal(module.quant(eye).t(), plain[name].weight), name


CASES = {
    "awq-g128-llama": ("llama", "awq", {"group_size": 128}),
    "awq-g32-qwen3": ("qwen3", "awq", {"group_size": 32}),
    "gptq-g128-sym-qwen2": ("qwen2", "gptq", {"group_size": 128, "sym": True}),
    "gptq-g64-act-order-qwen3": ("qwen3", "gptq", {"group_size": 64, "desc_act": True}),
    "gptq-whole-rows-v2-llama": (
        "llama", "gptq", {"group_size": -1, "checkpoint_format": "gptq_v2"}
    ),
}  # fmt: skip


FAST_CASES = ("awq-g128-llama", "gptq-g64-act-order-qwen3")  # the others with the slow tests


@pytest.mark.parametrize(
    "case", [c if c in FAST_CASES else pytest.param(c, marks=pytest.mark.slow) for c in CASES]
)
def test_checkpoint_loads_its_exact_weights_and_hf_greedy_tokens(case, tmp_path, monkeypatch):
    arch, method, options = CASES[case]
    path, float_path, hf = write_checkpoint(arch, tmp_path, method, **options)
    monkeypatch.setattr(quantization, "CPU_KERNELS", False)  # float32 products
    model = _load(path, quantization=method)
    reference = _load(float_path)
    assert_exact_dequantization(model, reference)
    for name, p in reference.named_parameters():  # embeddings, norms, biases, LM head
        if not name.endswith("proj.weight"):
            assert torch.equal(dict(model.named_parameters())[name], p), name
    cfg, ids = load_hf_config(path), list(range(3, 15))
    assert PagedRunner(model, cfg).greedy(0, ids, 8, eos_ids(hf)) == hf_greedy(hf, ids, 8)
    (logits,) = PagedRunner(model, cfg).step([(0, ids)])
    assert rel_err(logits, hf_logits(hf, ids)) < 1e-4


@pytest.mark.parametrize("case", ["awq-g128-llama", "gptq-g64-act-order-qwen3"])
def test_cpu_kernel_path_is_as_close_to_hf_as_bfloat16_weights(case, tmp_path):
    """torch's int4 kernel takes bfloat16 activations (and scales): its logits are as far
    from HF's float32 ones as the same weights' float model run in bfloat16 (about 2% on
    these sharp random models), where a wrong code, scale or order is off by O(1)."""
    if not quantization.CPU_KERNELS:
        pytest.skip("this torch has no CPU int4 kernel")
    arch, method, options = CASES[case]
    path, float_path, hf = write_checkpoint(arch, tmp_path, method, **options)
    model = _load(path, quantization=method)
    assert all(m.quant.cpu_kernel for m in _linears(model).values())
    bfloat16 = load_model(float_path, load_hf_config(float_path), torch.bfloat16, CPU)
    ids, cfg = list(range(3, 15)), load_hf_config(path)
    ref = hf_logits(hf, ids)
    (logits,) = PagedRunner(model, cfg).step([(0, ids)])
    (bf16_logits,) = PagedRunner(bfloat16, cfg).step([(0, ids)])
    assert rel_err(logits, ref) < 1.5 * rel_err(bf16_logits.float(), ref)


def _shards(path: str, **kwargs) -> list:
    try:
        models = []
        for rank in range(2):
            set_tp(rank, 2, None)
            models.append(_load(path, **kwargs))
        return models
    finally:
        set_tp(0, 1, None)


def test_each_tensor_parallel_rank_keeps_its_groups(tmp_path, monkeypatch):
    """Two ranks: each projection's shard (fused q/k/v and gate/up split by rows, o and down
    by whole groups of input features) holds exactly that shard of the reference weights."""
    path, float_path, _ = write_checkpoint("llama", tmp_path, "awq", group_size=64)
    monkeypatch.setattr(quantization, "CPU_KERNELS", False)
    for shard, reference in zip(
        _shards(path, quantization="awq"), _shards(float_path), strict=True
    ):
        assert_exact_dequantization(shard, reference)


@pytest.mark.parametrize(
    "method,options,match",
    [
        ("awq", {"group_size": 128}, "o_proj holds 64 input features on this rank"),
        ("gptq", {"group_size": 32, "desc_act": True}, "act order .desc_act."),
    ],
)
def test_shards_that_split_groups_raise(tmp_path, method, options, match):
    path, _, _ = write_checkpoint("llama", tmp_path, method, **options)
    with pytest.raises(ValueError, match=match):
        _shards(path, quantization=method)


@pytest.mark.parametrize("case", ["awq-g128-llama", "gptq-g64-act-order-qwen3"])
def test_four_bit_layers_are_never_made_or_read_in_float(case, tmp_path, monkeypatch):
    """The load keeps each 4-bit layer without a float detour: no packed layer is read as
    float values, and each Int4Weight is built on codes with its Linear's weight still a
    meta tensor (never made on the device)."""
    from octavo.quant.awq_gptq import _Layer

    arch, method, options = CASES[case]
    path, _, _ = write_checkpoint(arch, tmp_path, method, **options)
    narrowed, built = [], []
    narrow, init = _Layer.narrow, quantization.Int4Weight.__init__

    def spy_narrow(self, *args):
        narrowed.append(self.part)
        return narrow(self, *args)

    def spy_init(self, weight, *args, **kwargs):
        built.append((weight.is_meta, kwargs.get("codes") is not None))
        init(self, weight, *args, **kwargs)

    monkeypatch.setattr(_Layer, "narrow", spy_narrow)
    monkeypatch.setattr(quantization.Int4Weight, "__init__", spy_init)
    model = _load(path, quantization=method)
    assert "float" not in narrowed and "codes" in narrowed
    assert built == [(True, True)] * len(_linears(model))


# Projections stored in float beside 4-bit ones (as a checkpoint's modules_to_not_convert).
FLOAT_PARTS = ("layers.0.self_attn.v_proj", "layers.1.self_attn.o_proj", "layers.1.mlp.up_proj")


@pytest.mark.parametrize(
    "method,options,ranks",
    [("awq", {}, 1), ("awq", {}, 2), ("gptq", {"desc_act": True}, 1), ("gptq", {}, 2)],
)
def test_a_layer_with_a_float_part_loads_as_float(tmp_path, monkeypatch, method, options, ranks):
    """A fused Linear with one float part (v of qkv, up of gate_up) and a plain one in float
    (o) load as float, their 4-bit parts dequantized, on each tensor-parallel rank; the
    others keep their groups; q/k/v biases (Qwen2) load alike."""
    path, float_path, _ = write_checkpoint("qwen2", tmp_path, method, group_size=32, **options)
    tensors, floats = (
        load_file(f"{path}/model.safetensors"),
        load_file(f"{float_path}/model.safetensors"),
    )
    for part in FLOAT_PARTS:
        prefix = f"model.{part}"
        for suffix in ("qweight", "qzeros", "scales", "g_idx"):
            tensors.pop(f"{prefix}.{suffix}", None)
        tensors[f"{prefix}.weight"] = floats[f"{prefix}.weight"]
    save_file(tensors, f"{path}/model.safetensors")
    monkeypatch.setattr(quantization, "CPU_KERNELS", False)
    if ranks == 1:
        shards, references = [_load(path, quantization=method)], [_load(float_path)]
    else:
        shards, references = _shards(path, quantization=method), _shards(float_path)
    float_linears = (
        "layers.0.self_attn.qkv_proj",
        "layers.1.self_attn.o_proj",
        "layers.1.mlp.gate_up_proj",
    )
    for model, reference in zip(shards, references, strict=True):
        plain = dict(reference.named_parameters())
        for name, p in model.named_parameters():  # float weights, biases, norms, embeddings
            assert ".quant." in name or torch.equal(p, plain[name]), name
        for name, module in _linears(model).items():
            if name.endswith(float_linears):
                assert module.quant is None and module.weight.device == CPU, name
                continue
            eye = torch.eye(module.quant.in_features)
            assert torch.equal(module.quant(eye).t(), plain[f"{name}.weight"]), name


def test_placing_raises_when_a_linears_parts_do_not_all_land(tmp_path):
    """place() with `finish`: a fused Linear that got only some of its parts (q, not k and v)
    is a RuntimeError, not a Linear left half placed; the weight loaders are restored."""
    from octavo.quant.method import place

    _, float_path, _ = write_checkpoint("llama", tmp_path, "awq", group_size=64)
    net = _load(float_path)
    qkv = net.model.layers[0].self_attn.qkv_proj
    stream = [("model.layers.0.self_attn.q_proj.weight", torch.zeros(128, 128))]
    finished = []
    with pytest.raises(RuntimeError, match="tensors of 1 Linears did not all land"):
        make = {qkv: lambda: torch.empty_like(qkv.weight)}
        place(net, make, iter(stream), lambda m, scratch: finished.append(m))
    assert finished == [] and qkv.weight.weight_loader == qkv.weight_loader


ENGINE = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 64, "max_model_len": 256}


def _engine_tokens(llm, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outs]


def test_llm_reads_the_checkpoints_method_by_default(tmp_path, monkeypatch):
    """LLM(path) with quantization="auto" keeps a GPTQ checkpoint's groups and gives HF's
    greedy tokens on the dequantized weights (float32 products)."""
    path, _, hf = write_checkpoint("llama", tmp_path, "gptq", group_size=64)
    monkeypatch.setattr(quantization, "CPU_KERNELS", False)
    llm = LLM(path, **ENGINE)
    runner = llm.engine.runner
    assert all(m.weight is None for m in _linears(runner.model).values())
    prompts = [list(range(3 + i, 20 + i)) for i in range(3)]
    assert _engine_tokens(llm, prompts) == [hf_greedy(hf, p, 8) for p in prompts]


@pytest.mark.slow
def test_two_gloo_ranks_give_one_ranks_tokens(tmp_path):
    path, _, _ = write_checkpoint("llama", tmp_path, "gptq", group_size=64)
    prompts = [list(range(3 + i, 20 + i)) for i in range(3)]
    two = LLM(path, tensor_parallel_size=2, **ENGINE)
    try:
        assert _engine_tokens(two, prompts) == _engine_tokens(LLM(path, **ENGINE), prompts)
    finally:
        two.shutdown()


def test_packing_orders_of_one_word():
    """The formats' own nibble orders on a literal word: AWQ puts output columns 0..7 in
    nibbles 0, 4, 1, 5, 2, 6, 3, 7 (AutoAWQ's order_map [0, 2, 4, 6, 1, 3, 5, 7]); GPTQ
    puts input rows 0..7 in nibbles 0..7."""
    word = torch.tensor([[0x75316420]], dtype=torch.int32)
    assert _unpack(word, 1, AWQ_ORDER).tolist() == [list(range(8))]
    word = torch.tensor([[0x76543210]], dtype=torch.int32)
    assert _unpack(word, 0, range(8)).flatten().tolist() == list(range(8))
    negative = torch.tensor([[-0x0FFFFFFF - 1]], dtype=torch.int32)  # 0xF0000000
    assert _unpack(negative, 1, range(8)).tolist() == [[0] * 7 + [15]]


def test_options_that_do_not_fit_the_checkpoint_raise(tmp_path):
    from octavo.quant import resolve_quantization

    path, float_path, _ = write_checkpoint("qwen3", tmp_path, "awq", group_size=32)
    cfg = load_hf_config(path)
    assert resolve_quantization("auto", path, cfg, CPU, "auto") == "awq"
    assert resolve_quantization("auto", path, cfg, CPU, "dummy") is None
    for option in ("int8", "gptq", None):
        with pytest.raises(ValueError, match=f"quantization={option!r} .*quant_method 'awq'"):
            _load(path, quantization=option)
    with pytest.raises(ValueError, match="quantization='awq' .*has no quantization_config"):
        _load(float_path, quantization="awq")
    with pytest.raises(ValueError, match="quantization='gptq' .*load_format='dummy'"):
        _load(path, quantization="gptq", load_format="dummy")
    with pytest.raises(ValueError, match="quantization='awq' cannot quantize float weights"):
        rtn.quantize_weight("awq", torch.randn(8, 32))


@pytest.mark.parametrize(
    "change,match",
    [
        ({"bits": 8}, "bits=8"),
        ({"version": "gemv"}, "version='gemv'"),
        ({"group_size": 16}, "group_size=16"),
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
    ],
)
def test_quantization_configs_octavo_does_not_read_raise(tmp_path, change, match):
    path, _, _ = write_checkpoint("qwen3", tmp_path, "awq", group_size=32)
    config_path = tmp_path / "awq" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] |= change
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        _load(path, quantization=None if "quant_method" in change else "awq")


class _Recorded:
    """A lazy tensor (as checkpoint/loader.py's LazyTensor) that records what is read of it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.shape, self.reads = tensor, tuple(tensor.shape), []

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        self.reads.append((dim, length))
        return self.tensor.narrow(dim, start, length)


@pytest.mark.parametrize("part", ["float", "codes", "groups", "group_ids"])
@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_a_rank_reads_only_the_qweight_words_of_its_slice(method, part):
    """A packed layer narrowed to some output rows or input features (as a column- or
    row-parallel rank's loader narrows it) equals the whole layer's slice, unaligned to the
    eight-value words too, and reads only the words that hold the slice (no qweight at all
    for the groups and group ids). The groups count two columns a run of 32 input features:
    a slice of whole runs is narrowed in those units."""
    from octavo.quant.awq_gptq import Int4Format, _Layer

    k, n, group = 256, 64, 64
    gen = torch.Generator().manual_seed(0)
    words = (k, n // 8) if method == "awq" else (k // 8, n)
    tensors = {
        "qweight": torch.randint(-(2**31), 2**31 - 1, words, dtype=torch.int32, generator=gen),
        "qzeros": torch.randint(-(2**31), 2**31 - 1, (k // group, n // 8), dtype=torch.int32),
        "scales": torch.rand(k // group, n, generator=gen).half(),
    }
    if method == "gptq":  # act order: the groups numbered out of order
        tensors["g_idx"] = (torch.arange(k) // group).flip(0).int()
    fmt = Int4Format(method, group, 32, method == "gptq", 0)
    unit = 16 if part == "groups" else 1
    whole = _Layer("layer", tensors, fmt, part).narrow(0, 0, n)
    assert whole.shape == (n, k // unit)
    for dim, start, length in ((0, 16, 24), (0, 12, 20), (1, 64, 128), (1, 12, 100)):
        if dim == 1 and part == "groups":
            if start % 32 or length % 32:
                continue  # not whole runs
            start, length = start // unit, length // unit
        recorded = _Recorded(tensors["qweight"])
        layer = _Layer("layer", {**tensors, "qweight": recorded}, fmt, part)
        got = layer.narrow(dim, start, length)
        assert torch.equal(got, whole.narrow(dim, start, length))
        if part in ("groups", "group_ids"):
            assert recorded.reads == []
            continue
        ((read_dim, read),) = recorded.reads  # one read, along the words' dimension
        assert read_dim == 1 - dim and read < words[read_dim]


def test_groups_of_a_run_are_its_groups_scale_and_minimum():
    """The groups part on a literal layer: runs of 32 input features in g_idx's order, each
    with its group's scale and minimum (-zero * scale)."""
    from octavo.quant.awq_gptq import Int4Format, _Layer

    k, n, group = 128, 8, 64
    scales = torch.tensor([[1.0] * n, [2.0] * n]).half()  # [G, N]
    zeros = torch.tensor([[0x33333333], [0x55555555]], dtype=torch.int32)  # zero 3, then 5
    tensors = {
        "qweight": torch.zeros(k // 8, n, dtype=torch.int32),
        "qzeros": zeros,
        "scales": scales,
        "g_idx": (torch.arange(k) // group).flip(0).int(),  # group 1 first along K
    }
    fmt = Int4Format("gptq", group, 32, True, 0)
    got = _Layer("layer", tensors, fmt, "groups").narrow(0, 0, n)
    # sorted by group: runs 0, 1 are group 0 (scale 1, min -3), runs 2, 3 group 1 (2, -10)
    assert got.tolist() == [[1.0, -3.0, 1.0, -3.0, 2.0, -10.0, 2.0, -10.0]] * n
