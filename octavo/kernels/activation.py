"""Gated activations in one kernel: x [T, 2I] -> act(x[:, :I]) * x[:, I:].

    silu_and_mul       SwiGLU (Llama, Qwen): computed in float32 and rounded once. The torch
                       reference is `octavo.model.layers.SiluAndMul` on a CPU tensor.
    gelu_tanh_and_mul  GeGLU (Gemma): the tanh-approximated gelu rounded to the dtype, then
                       the product, as HF's `gelu_pytorch_tanh(gate) * up` rounds each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.kernels.pdl import pdl_args


@triton.jit
def _act_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    inter_size,
    GELU_TANH: tl.constexpr,  # GeGLU's gate, else SwiGLU's
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's writes are visible from here
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter_size
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter_size + offs, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    if not GELU_TANH:
        out = g / (1.0 + tl.exp(-g)) * up
    else:  # 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), as torch's tanh gelu
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        tanh = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)  # saturates to +-1 at large |inner|
        act = (0.5 * g * (1.0 + tanh)).to(gate.dtype)
        out = act.to(tl.float32) * up
    tl.store(out_ptr + row * inter_size + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _act_and_mul(x: torch.Tensor, gelu_tanh: bool, name: str) -> torch.Tensor:
    num_rows, width = x.shape
    if width % 2 or x.stride(-1) != 1:
        raise ValueError(f"{name} needs [T, 2I] with a contiguous last dim, got {x.shape}")
    inter = width // 2
    out = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(inter), 2048)
    if num_rows:
        _act_and_mul_kernel[(num_rows, triton.cdiv(inter, block))](
            x,
            out,
            x.stride(0),
            inter,
            GELU_TANH=gelu_tanh,
            BLOCK=block,
            num_warps=4 if block >= 1024 else 1,
            **pdl_args(x.device),
        )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 * I] (last dim contiguous) -> silu(gate) * up, [T, I] in x's dtype."""
    return _act_and_mul(x, False, "silu_and_mul")


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 * I] (last dim contiguous) -> gelu_tanh(gate) * up, [T, I] in x's dtype."""
    return _act_and_mul(x, True, "gelu_tanh_and_mul")
