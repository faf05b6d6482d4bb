"""SwiGLU's gate in one kernel: x [T, 2I] -> silu(x[:, :I]) * x[:, I:], computed in float32
and rounded once. The torch reference is `octavo.model.layers.SiluAndMul` on a CPU tensor."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.kernels.pdl import pdl_args


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, inter_size, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's writes are visible from here
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter_size
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter_size + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * inter_size + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 * I] (last dim contiguous) -> [T, I] in x's dtype."""
    num_rows, width = x.shape
    if width % 2 or x.stride(-1) != 1:
        raise ValueError(f"silu_and_mul needs [T, 2I] with a contiguous last dim, got {x.shape}")
    inter = width // 2
    out = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(inter), 2048)
    if num_rows:
        _silu_and_mul_kernel[(num_rows, triton.cdiv(inter, block))](
            x,
            out,
            x.stride(0),
            inter,
            BLOCK=block,
            num_warps=4 if block >= 1024 else 1,
            **pdl_args(x.device),
        )
    return out
