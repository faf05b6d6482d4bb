"""Fp8BlockWeight on CUDA against the torch dequantize-then-matmul reference, on fresh random
inputs: on Hopper torch's block-scaled GEMM (F.scaled_mm, BlockWise1x128 activations against
BlockWise128x128 weights) and, at one row, the Triton GEMV (tests/gpu/test_quant_gemm.py
checks it exactly); elsewhere and for shapes off whole blocks the emulated path; and an HF fp8
checkpoint loaded on the GPU against its dequantized twin on the CPU, without ever holding
its projections in bfloat16.
"""

from __future__ import annotations

import gc

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from fp8_checkpoints import KEPT_FLOAT, per_block, write_checkpoints
from model_utils import PagedRunner

from octavo.checkpoint.hf_config import load_hf_config
from octavo.checkpoint.loader import load_model
from octavo.model.layers import Linear
from octavo.quant import fp8, rounding

pytestmark = pytest.mark.gpu
HOPPER = torch.cuda.get_device_capability()[0] == 9  # where torch's block-scaled GEMM runs
# (N, K): K blocks a multiple of 4 and not (cuBLASLt reads them padded to 4s), Qwen3-8B's
# o_proj and down_proj, and a shape off whole blocks (emulated).
SHAPES = [(256, 512), (384, 640), (1024, 384), (4096, 4096), (4096, 12288), (320, 576)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


def _layer(n: int, k: int, seed: int) -> tuple[fp8.Fp8BlockWeight, torch.Tensor]:
    """A block weight whose blocks have magnitudes 2^-4..2^4 (a scale read from the wrong
    block is off by up to 2^8), and its float64 dequantized weight."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = 2 ** (torch.rand(-(-n // 128), -(-k // 128), generator=gen) * 8 - 4)
    w = torch.randn(n, k, generator=gen) * per_block(magnitude, (n, k))
    codes, scale = rounding.quantize_fp8_blocks(w, 128, 128)
    layer = fp8.Fp8BlockWeight(codes.cuda(), scale.cuda(), torch.bfloat16)
    return layer, rounding.dequantize_fp8_blocks(codes, scale, 128, 128, torch.float64)


def _reference(x: torch.Tensor, w: torch.Tensor, gemv: bool = False) -> torch.Tensor:
    """x quantized per token and 128 columns (W8A8), or as it is (gemv: W8A16, one row)."""
    if gemv:
        return x.cpu().double() @ w.T
    xq, x_scale = rounding.quantize_fp8_blocks(x.cpu(), 1, 128)
    return rounding.dequantize_fp8_blocks(xq, x_scale, 1, 128, torch.float64) @ w.T


@pytest.mark.parametrize("n,k", SHAPES)
def test_fp8_blocks_match_the_dequantized_reference(n, k):
    layer, w = _layer(n, k, seed=n * k)
    assert layer.scaled_mm == (HOPPER and n % 128 == 0 and k % 128 == 0)
    for rows in (1, 7, 64, 300):
        x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3).to(
            torch.bfloat16
        )
        y = layer(x.cuda())
        assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
        gemv = layer.scaled_mm and rows == 1  # the Triton GEMV, x kept in bf16
        err = rel_err(y, _reference(x, w, gemv))
        assert err < (3e-3 if gemv else 1e-2), rows  # bf16 output; a wrong block: O(1)


def test_fp8_blocks_replay_in_a_cuda_graph():
    layer, w = _layer(512, 640, seed=0)
    x = torch.zeros(8, 640, dtype=torch.bfloat16, device="cuda")
    layer(x)  # loads the kernels before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(x)
    fresh = torch.randn(8, 640, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x.copy_(fresh)
    graph.replay()
    assert rel_err(y, _reference(fresh, w)) < 1e-2


def test_fp8_checkpoint_loads_on_the_gpu(tmp_path):
    """Whole blocks everywhere (hidden 256), so every quantized projection runs torch's GEMM
    on Hopper: the weights dequantize exactly to the twin's, and the logits stay within the
    activations' e4m3 rounding of the float twin's (a wrong block would be off by O(1))."""
    fp8_path, twin_path = write_checkpoints(tmp_path, "qwen3", hidden_size=256)
    cfg, twin_cfg = load_hf_config(fp8_path), load_hf_config(twin_path)
    gc.collect()  # an earlier test's tensors, freed now rather than during the load
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = load_model(fp8_path, cfg, torch.bfloat16, torch.device("cuda"), quantization="fp8")
    # The codes are placed as they are: the load never holds the projections in bfloat16.
    peak, held = (torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base)
    kept = [m.quant for m in model.modules() if isinstance(m, Linear) and m.quant is not None]
    bf16_bytes = sum(2 * quant.qweight.numel() for quant in kept)
    assert peak - held < 0.25 * bf16_bytes, (peak, held, bf16_bytes)
    twin = load_model(twin_path, twin_cfg, torch.float32, torch.device("cpu"))
    twin_linears = dict(twin.named_modules())
    quantized = 0
    for name, linear in model.named_modules():
        if isinstance(linear, Linear) and not name.startswith(KEPT_FLOAT):
            quant = linear.quant
            assert quant.scaled_mm == HOPPER, name
            w = rounding.dequantize_fp8_blocks(
                quant.qweight.cpu(), quant.scale.cpu(), 128, 128, torch.float32
            )
            assert torch.equal(w, twin_linears[name].weight), name
            quantized += 1
    assert quantized == 4 * cfg.num_hidden_layers - 1
    prompt = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    (logits,) = PagedRunner(model, cfg).step([(0, prompt)])
    (ref,) = PagedRunner(twin, twin_cfg).step([(0, prompt)])
    assert rel_err(logits, ref) < 0.3
