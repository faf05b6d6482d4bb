"""The activation quantization kernels (per token; per token and 128 columns) against their
torch references, quantize_fp8 and quantize_fp8_blocks, on fresh random inputs: the same
scales, and codes equal but for a rare tie rounded the other way. With
OCTAVO_TRITON_INTERPRET=1 a small subset runs on the CPU through Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("OCTAVO_TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA (or OCTAVO_TRITON_INTERPRET=1)", allow_module_level=True)

from octavo.kernels.quant_fp8 import per_group_quant_fp8, per_token_quant_fp8
from octavo.quant.rounding import quantize_fp8, quantize_fp8_blocks

pytestmark = pytest.mark.gpu
DEVICE = "cpu" if INTERPRET else "cuda"
SHAPES = [(1, 128), (3, 640), (5, 4096 + 128)] + ([] if INTERPRET else [(257, 12288), (64, 4096)])


def _inputs(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.rand(rows, 1, generator=gen) * 10
    x[0, : cols // 2] = 0  # a row's zero half, and (per group) whole zero groups
    return x.to(dtype).to(DEVICE)


def _assert_codes_close(q: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal codes, but for at most 0.1% one e4m3 step apart (a tie after the division)."""
    a, b = q.float().cpu(), ref.float().cpu()
    differ = a != b
    assert differ.float().mean() <= 1e-3
    assert torch.allclose(a[differ], b[differ], rtol=0.13)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_per_token_matches_quantize_fp8(shape, dtype):
    x = _inputs(*shape, dtype, seed=shape[0] * 7 + shape[1])
    q, scale = per_token_quant_fp8(x)
    ref_q, ref_scale = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    _assert_codes_close(q, ref_q)


@pytest.mark.parametrize("column_major", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_per_group_matches_quantize_fp8_blocks(shape, column_major):
    x = _inputs(*shape, torch.bfloat16, seed=shape[0] * 11 + shape[1])
    q, scale = per_group_quant_fp8(x, 128, column_major_scales=column_major)
    ref_q, ref_scale = quantize_fp8_blocks(x, 1, 128)
    assert scale.shape == ref_scale.shape
    assert (scale.stride(0) == 1) == column_major or shape[0] == 1
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    _assert_codes_close(q, ref_q)


def test_a_strided_input_is_read_as_its_values():
    x = _inputs(4, 512, torch.bfloat16, seed=3)[:, :256]
    q, scale = per_token_quant_fp8(x)
    ref_q, ref_scale = quantize_fp8(x)
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    _assert_codes_close(q, ref_q)
