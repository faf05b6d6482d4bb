"""AWQ and GPTQ checkpoints loaded on CUDA in bfloat16: every projection keeps its 4-bit
groups for the Triton W4A16 kernels and equals the reference dequantization within the
grid's bfloat16 rounding, the logits stay as close to HF's as the float model's in bfloat16,
and the load never holds the float projections: its peak allocation stays far below their
bfloat16 size beyond what the loaded model holds. A float checkpoint quantized on load
(int8, int4, fp8) peaks at most 8 times its largest projection above the loaded model."""

from __future__ import annotations

import gc

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from int4_checkpoints import write_checkpoint
from model_utils import PagedRunner, hf_logits, rel_err

from octavo.checkpoint.hf_config import load_hf_config
from octavo.checkpoint.loader import load_model
from octavo.model.layers import Linear
from octavo.quant import rtn

CUDA = torch.device("cuda")
# Heads of 128 and an MLP of 4096: projections of 1-8 M weights, 8 layers of them, so that a
# float copy (~240 MB in bfloat16) stands out against the packed model and against the
# scratch of the one Linear in flight (its codes and their packing, ~40 MB at most).
DIMS = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 128,
}
CASES = {
    "awq-g128-llama": ("llama", "awq", {"group_size": 128}),
    "gptq-g64-act-order-qwen3": ("qwen3", "gptq", {"group_size": 64, "desc_act": True}),
}


def _measured_load(path: str, method: str) -> tuple[torch.nn.Module, int, int]:
    """load_model(path) in bfloat16 on CUDA with quantization=method: (the model, the load's
    peak allocation, what the model holds), both in bytes above what was allocated before."""
    gc.collect()  # an earlier test's tensors, freed now rather than during the load
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = load_model(path, load_hf_config(path), torch.bfloat16, CUDA, quantization=method)
    peak = torch.cuda.max_memory_allocated() - base
    return model, peak, torch.cuda.memory_allocated() - base


@pytest.mark.parametrize("case", list(CASES))
def test_int4_checkpoint_loads_on_the_gpu_without_float_weights(case, tmp_path):
    arch, method, options = CASES[case]
    path, float_path, hf = write_checkpoint(arch, tmp_path, method, dims=DIMS, **options)
    cfg, float_cfg = load_hf_config(path), load_hf_config(float_path)
    model, peak, held = _measured_load(path, method)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    float_bytes = sum(2 * m.quant.out_features * m.quant.in_features for m in linears.values())
    assert peak - held < 0.25 * float_bytes, (peak, held, float_bytes)

    reference = dict(load_model(float_path, float_cfg, torch.float32, CUDA).named_modules())
    for name, linear in linears.items():
        assert linear.weight is None and linear.quant.gpu_kernel, name
        eye = torch.eye(linear.quant.in_features, dtype=torch.bfloat16, device=CUDA)
        assert rel_err(linear.quant(eye).t(), reference[name].weight) < 1e-2, name

    ids = list(range(3, 40))
    ref = hf_logits(hf, ids)
    (logits,) = PagedRunner(model, cfg).step([(0, ids)])
    bf16 = load_model(float_path, float_cfg, torch.bfloat16, CUDA)
    (bf16_logits,) = PagedRunner(bf16, float_cfg).step([(0, ids)])
    assert rel_err(logits.float().cpu(), ref) < 1.5 * rel_err(bf16_logits.float().cpu(), ref)


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_float_checkpoint_quantized_on_load_never_holds_the_float_projections(method, tmp_path):
    """Each Linear is quantized as soon as its bfloat16 weight lands: beyond the loaded model
    the peak holds one Linear's weight and its quantizer's float32 work, a few times the
    largest projection, where the bfloat16 projections are 15 times it; and the model
    equals the bfloat16 model with each Linear quantized after its load."""
    _, float_path, _ = write_checkpoint("llama", tmp_path, "awq", dims=DIMS)
    cfg = load_hf_config(float_path)
    model, peak, held = _measured_load(float_path, method)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    sizes = [2 * m.quant.out_features * m.quant.in_features for m in linears]
    print(f"{method}: peak {peak / 2**20:.0f} MiB, held {held / 2**20:.0f} MiB, projections in "
          f"bf16 {sum(sizes) / 2**20:.0f} MiB, the largest {max(sizes) / 2**20:.0f} MiB")  # fmt: skip
    assert peak - held < 8 * max(sizes) < sum(sizes) / 1.5, (peak, held, sizes)

    reference = load_model(float_path, cfg, torch.bfloat16, CUDA)
    for m in reference.modules():
        if isinstance(m, Linear):
            rtn.quantize(m, method)
    expected = reference.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
