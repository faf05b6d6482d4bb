"""HF fp8 checkpoints read as they are (quant/fp8_checkpoint.py), on a tiny random Qwen3 /
Llama written in the layout of Qwen3's FP8 releases next to its dequantized float32 twin
(tests/fp8_checkpoints.py).

Loaded, each projection dequantizes exactly to the twin's weights, whole and on each
tensor-parallel rank; logits and greedy tokens equal the twin's once the twin's projections
quantize their inputs as W8A8 does. Shards and fused parts off the 128 x 128 blocks, options
that disagree with the checkpoint and quantization_configs octavo cannot read are ValueErrors
naming the cause.
"""

from __future__ import annotations

import pytest
import torch
from fp8_checkpoints import CONFIGS, FP8_CONFIG, KEPT_FLOAT, write_checkpoints
from model_utils import PagedRunner, rel_err
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from octavo.checkpoint.hf_config import load_hf_config
from octavo.checkpoint.loader import load_model
from octavo.model.layers import Linear
from octavo.model.parallel import set_tp
from octavo.quant import checkpoint_method, get_method, resolve_quantization
from octavo.quant.fp8 import Fp8BlockWeight, Fp8Weight
from octavo.quant.rounding import dequantize_fp8_blocks, quantize_fp8_blocks


def _load(path: str, quantization: str | None = None, load_format: str = "auto"):
    cfg = load_hf_config(path)
    model = load_model(path, cfg, torch.float32, torch.device("cpu"), load_format, 0, quantization)
    return model, cfg


def _linears(model) -> dict[str, Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear)}


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoints(request, tmp_path_factory):
    return write_checkpoints(tmp_path_factory.mktemp(request.param), request.param)


def _assert_dequantizes_to(fp8_model, twin_model) -> None:
    twin = _linears(twin_model)
    for name, linear in _linears(fp8_model).items():
        if name.startswith(KEPT_FLOAT):
            assert linear.quant is None, name
            assert torch.equal(linear.weight, twin[name].weight), name
            continue
        assert isinstance(linear.quant, Fp8BlockWeight) and linear.weight is None, name
        quant = linear.quant
        assert quant.qweight.dtype == torch.float8_e4m3fn, name
        w = dequantize_fp8_blocks(quant.qweight, quant.scale, 128, 128, torch.float32)
        assert torch.equal(w, twin[name].weight), name


def test_loaded_weights_dequantize_exactly_to_the_reference(checkpoints):
    fp8_path, twin_path = checkpoints
    _assert_dequantizes_to(_load(fp8_path, "fp8")[0], _load(twin_path)[0])


class _Reads:
    """A lazy checkpoint tensor that records, for each e4m3 slice read of it, the dtype of
    the tensor the weight loader was asked to place it in."""

    def __init__(self, lazy, param, seen: list) -> None:
        self.lazy, self.param, self.seen, self.shape = lazy, param, seen, lazy.shape

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        read = self.lazy.narrow(dim, start, length)
        if read.dtype == torch.float8_e4m3fn:
            self.seen.append(self.param.dtype)
        return read


def test_codes_are_never_made_in_float(checkpoints, monkeypatch):
    """The e4m3 codes reach the weight loaders only to be placed into e4m3 scratch: no
    projection's float weight is made and filled with them (the float model never exists)."""
    from octavo.model import layers

    seen = []
    for cls in (layers.Linear, layers.RowParallelLinear, layers._FusedLinear):

        def spy(self, param, loaded, *shard_id, loader=cls.weight_loader):
            if isinstance(param, torch.Tensor) and hasattr(loaded, "_slice"):  # a LazyTensor
                loaded = _Reads(loaded, param, seen)
            loader(self, param, loaded, *shard_id)

        monkeypatch.setattr(cls, "weight_loader", spy)
    _load(checkpoints[0], "fp8")
    assert seen and set(seen) == {torch.float8_e4m3fn}


def test_each_rank_dequantizes_exactly_to_its_slices(checkpoints):
    """Tensor parallelism: q heads, gate/up rows and o/down columns split on whole blocks,
    k/v (one KV head) replicated; each rank's scales are those of its own slices."""
    fp8_path, twin_path = checkpoints
    try:
        for rank in range(2):
            set_tp(rank, 2, None)
            _assert_dequantizes_to(_load(fp8_path, "fp8")[0], _load(twin_path)[0])
    finally:
        set_tp(0, 1, None)


def _quantize_inputs(model) -> None:
    """Makes the float model's projections (those the checkpoint quantizes) quantize their
    inputs as W8A8 does: e4m3 per token and 128 columns, and back."""
    for name, linear in _linears(model).items():
        if not name.startswith(KEPT_FLOAT):
            forward = linear.forward
            linear.forward = lambda x, forward=forward: forward(
                dequantize_fp8_blocks(*quantize_fp8_blocks(x, 1, 128), 1, 128, x.dtype)
            )


def test_greedy_tokens_equal_the_dequantized_float_model(checkpoints):
    """Against the float twin whose projections quantize their inputs the same way: the same
    logits and greedy tokens. Against the plain twin: logits off by the activations' e4m3
    rounding only, which over a random model's layers is too much for greedy tokens to
    agree."""
    fp8_path, twin_path = checkpoints
    (fp8_model, cfg), (twin_model, _) = _load(fp8_path, "fp8"), _load(twin_path)
    prompt = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    (fp8_logits,) = PagedRunner(fp8_model, cfg).step([(0, prompt)])
    (twin_logits,) = PagedRunner(twin_model, cfg).step([(0, prompt)])
    assert 1e-3 < rel_err(fp8_logits, twin_logits) < 0.3
    _quantize_inputs(twin_model)
    (twin_logits,) = PagedRunner(twin_model, cfg).step([(0, prompt)])
    assert rel_err(fp8_logits, twin_logits) < 1e-6
    tokens = PagedRunner(fp8_model, cfg).greedy(0, prompt, 8)
    assert tokens == PagedRunner(twin_model, cfg).greedy(0, prompt, 8)


def test_auto_takes_the_checkpoint_quantization_and_others_disagree(checkpoints):
    from octavo.engine.builder import build_engine

    cfg, cpu = load_hf_config(checkpoints[0]), torch.device("cpu")

    def checked(option, config, load_format="auto"):
        method = resolve_quantization(option, checkpoints[0], config, cpu, load_format)
        get_method(method, cpu, config, checkpoints[0], load_format)
        return method

    assert checkpoint_method(cfg) == "fp8"
    for option in ("auto", "fp8"):
        assert checked(option, cfg) == "fp8"
    assert checked("int8", load_hf_config(checkpoints[1])) == "int8"
    assert checked("int8", cfg, "dummy") == "int8"  # no checkpoint read
    for option in (None, "int8", "int4", "gguf"):
        with pytest.raises(ValueError, match=f"quantization={option!r} does not fit"):
            checked(option, cfg)
    with pytest.raises(ValueError, match="quantization=None does not fit"):
        _load(checkpoints[0], None)
    with pytest.raises(ValueError, match="quantization='int4' does not fit"):
        build_engine(checkpoints[0], device="cpu", quantization="int4")
    engine = build_engine(checkpoints[0], device="cpu", num_kv_blocks=8, max_num_seqs=2)
    assert isinstance(engine.runner.model.model.layers[0].mlp.down_proj.quant, Fp8BlockWeight)


def test_dummy_weights_stay_per_row(checkpoints):
    model, _ = _load(checkpoints[0], "fp8", load_format="dummy")
    quants = [m.quant for m in _linears(model).values()]
    assert quants and all(isinstance(q, Fp8Weight) for q in quants)


@pytest.mark.parametrize(
    "dims,tp,match",
    [
        ({"intermediate_size": 384}, 2, r"down_proj.weight: columns 192..384 of 384"),
        ({"head_dim": 64}, 1, r"qkv_proj.weight: rows 128..192 of 256"),
    ],
    ids=["shard-inside-a-block", "fused-part-inside-a-block"],
)
def test_slices_off_the_blocks_are_value_errors(tmp_path, dims, tp, match):
    fp8_path, _ = write_checkpoints(tmp_path, "qwen3", **dims)
    try:
        set_tp(tp - 1, tp, None)
        with pytest.raises(ValueError, match=match + ".*tensor-parallel"):
            _load(fp8_path, "fp8")
    finally:
        set_tp(0, 1, None)


def test_scales_for_part_of_a_fused_weight_are_a_value_error(tmp_path):
    fp8_path, _ = write_checkpoints(
        tmp_path, "qwen3", drop="model.layers.0.self_attn.k_proj.weight"
    )
    with pytest.raises(ValueError, match="cover only part of model.layers.0.self_attn.qkv_proj"):
        _load(fp8_path, "fp8")


@pytest.mark.parametrize(
    "name,scale,match",
    [
        (
            "model.layers.0.mlp.down_proj",
            torch.ones(1, 4),
            r"has shape \(1, 4\), expected \(3, 4\)",
        ),
        ("model.embed_tokens", torch.ones(2, 3), "fp8 scales for model.embed_tokens.weight"),
    ],
    ids=["wrong-shape", "not-a-projection"],
)
def test_scales_that_fit_no_projection_are_value_errors(tmp_path, name, scale, match):
    fp8_path, _ = write_checkpoints(tmp_path, "qwen3")
    tensors = load_file(f"{fp8_path}/model.safetensors")
    tensors[f"{name}.weight_scale_inv"] = scale
    save_file(tensors, f"{fp8_path}/model.safetensors")
    with pytest.raises(ValueError, match=match):
        _load(fp8_path, "fp8")


@pytest.mark.parametrize(
    "change,match",
    [
        ({"weight_block_size": None}, "without weight_block_size"),
        ({"weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\]"),
        ({"activation_scheme": "static"}, "activation_scheme='static'"),
        ({"fmt": "e5m2"}, "fmt='e5m2'"),
        ({"scale_fmt": "ue8m0"}, "scale_fmt='ue8m0'"),
        ({"quant_method": "compressed-tensors"}, "quant_method 'compressed-tensors'"),
    ],
)
def test_quantization_configs_not_read_as_they_are(change, match):
    config = Qwen3Config(
        quantization_config={k: v for k, v in (FP8_CONFIG | change).items() if v is not None}
    )
    with pytest.raises(ValueError, match=match):
        checkpoint_method(config)
    assert checkpoint_method(Qwen3Config()) is None


def test_an_fp8_mixture_of_experts_checkpoint_loads_its_experts_rounded_per_row(tmp_path):
    """Block-scaled experts dequantize exactly to the twin's and are then rounded per row, as
    quantization="fp8" rounds the twin's float experts: the same codes and scales. The dense
    projections keep their blocks, and the engine runs the model."""
    from octavo.model.moe import FusedMoE

    fp8_path, twin_path = write_checkpoints(tmp_path, "qwen3_moe")
    fp8_model, _ = _load(fp8_path, "fp8")
    twin_model, _ = _load(twin_path, "fp8")  # the float twin, every projection per row
    twins = dict(twin_model.named_modules())
    moes = [(m, twins[n]) for n, m in fp8_model.named_modules() if isinstance(m, FusedMoE)]
    assert moes
    for ours, theirs in moes:
        for name in ("w13", "w2"):
            assert getattr(ours, name).dtype == torch.float8_e4m3fn
            assert torch.equal(getattr(ours, name).float(), getattr(theirs, name).float())
            assert torch.equal(getattr(ours, f"{name}_scale"), getattr(theirs, f"{name}_scale"))
    assert isinstance(_linears(fp8_model)["model.layers.0.self_attn.qkv_proj"].quant,
                      Fp8BlockWeight)  # fmt: skip
    from octavo import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = [{"prompt_token_ids": [5, 17, 99, 3, 42]}]
    ours = LLM(fp8_path, quantization="fp8", device="cpu", num_kv_blocks=64)
    assert ours.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
