"""RMSNorm, optionally fused with the residual add of a pre-norm block, in one pass per row.

    residual_out = x + residual                    (in x's dtype, as torch adds them)
    out          = weight * to_dtype(r * rsqrt(mean(r^2) + eps)),  r = float32(residual_out)
                   (Llama's order; Gemma's, round_first=False: one rounding after the weight)

Unfused, torch runs ~9 kernels for this (add, cast, pow, mean, add, rsqrt, mul, cast, mul);
each is tiny at decode batch sizes, so their launch and tail cost dominates. The torch
reference is `octavo.model.layers.RMSNorm` on a non-CUDA tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.kernels.pdl import pdl_args


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [N, H]
    residual_ptr,  # [N, H] (read only if HAS_RESIDUAL)
    out_ptr,  # [N, H]
    residual_out_ptr,  # [N, H] (written only if HAS_RESIDUAL)
    weight_ptr,  # [H]
    stride_x,
    stride_r,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ROUND_FIRST: tl.constexpr,  # round the normed row to the dtype before the weight
    BLOCK: tl.constexpr,  # next power of two >= hidden_size
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (pdl.py)
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's writes are visible from here
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden_size
    # NOTE: arithmetic in float32, each result rounded to the dtype where torch rounds it.
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * hidden_size + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden_size + eps)
    normed = xf * inv_rms
    if ROUND_FIRST:  # HF's Llama rounds before the weight
        normed = normed.to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + offs, mask=mask).to(tl.float32)
    out = normed * weight
    tl.store(out_ptr + row * hidden_size + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    round_first: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of x [..., H] with weight [H] (round_first: the normed row
    rounded to x's dtype before the weight, as Llama; else one rounding at the end).

    Returns norm(x), or with a residual the pair (norm(x + residual), x + residual), both
    new contiguous tensors in x's dtype (with round_first, the first in the weight's dtype if
    that is wider, as HF's Llama promotes; Gemma's casts to x's).
    Rows may be strided (a slice of a larger tensor); the last dim must be contiguous.
    """
    hidden_size = x.shape[-1]
    x2 = x.reshape(-1, hidden_size)
    if x2.stride(-1) != 1 or weight.shape != (hidden_size,):
        raise ValueError(f"rms_norm needs [..., {hidden_size}] rows and a [{hidden_size}] weight")
    out_dtype = torch.promote_types(x.dtype, weight.dtype) if round_first else x.dtype
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    residual_out = r2 = None
    if residual is not None:
        r2 = residual.reshape(-1, hidden_size)
        residual_out = torch.empty_like(x2, memory_format=torch.contiguous_format)
    if x2.shape[0]:
        block = triton.next_power_of_2(hidden_size)
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            r2 if r2 is not None else x2,
            out,
            residual_out if residual_out is not None else out,
            weight,
            x2.stride(0),
            r2.stride(0) if r2 is not None else 0,
            hidden_size,
            eps,
            HAS_RESIDUAL=r2 is not None,
            ROUND_FIRST=round_first,
            BLOCK=block,
            num_warps=min(max(block // 512, 1), 16),
            **pdl_args(x.device),
        )
    out = out.view(x.shape)
    if residual_out is None:
        return out
    return out, residual_out.view(x.shape)
