"""fp8 (e4m3) weights, W8A8: activations quantized at each call.

    Fp8Weight       one float32 scale per output row, activations one per token
                    (quantization="fp8" on a float checkpoint; one row on Hopper: W8A16)
    Fp8BlockWeight  an HF fp8 checkpoint's scale per 128 x 128 block, activations one per
                    token and 128 columns

On Hopper, torch's scaled GEMMs through cuBLASLt, and one row through the Triton GEMV on the
same codes; elsewhere emulated (dequantized, then a matmul), the reference the GPU path is
tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from octavo.kernels import cpu as cpu_kernels
from octavo.quant.rounding import (
    FP8_BLOCK,
    dequantize_fp8_blocks,
    quantize_fp8,
    quantize_fp8_blocks,
)
from octavo.quant.weights import QuantizedWeight, frozen


class Fp8Weight(QuantizedWeight):
    """W8A8: e4m3 [N, K] and a float32 scale per row; each call quantizes x per token."""

    method = "fp8"

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight)
        q, scale = quantize_fp8(weight)
        self.qweight, self.scale = frozen(q), frozen(scale)
        # torch._scaled_mm's row-wise scales need Hopper, bfloat16 out and dims of 16s.
        self.scaled_mm = (
            weight.is_cuda
            and torch.cuda.get_device_capability(weight.device) >= (9, 0)
            and weight.dtype == torch.bfloat16
            and self.in_features % 16 == 0
            and self.out_features % 16 == 0
        )
        if self.scaled_mm:
            from octavo.kernels import quant_gemm

            quant_gemm.prepare(weight.device)  # the GEMV's split-K counters, before any graph

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scaled_mm and x.numel() == self.in_features:
            # One row: the Triton GEMV reads the codes as they are and keeps x in 16 bits;
            # cuBLASLt would pad the row to its fp8 tile.
            from octavo.kernels.quant_gemm import fp8_gemv

            return fp8_gemv(x, self.qweight, self.scale)
        if self.scaled_mm:
            from octavo.kernels.quant_fp8 import per_token_quant_fp8

            xq, x_scale = per_token_quant_fp8(x)  # [T, K] e4m3, [T]: one kernel
            return torch._scaled_mm(
                xq, self.qweight.t(), scale_a=x_scale[:, None], scale_b=self.scale[None, :],
                out_dtype=x.dtype,
            )  # fmt: skip
        xq, x_scale = quantize_fp8(x)
        y = cpu_kernels.dense(xq.to(x.dtype), self.qweight.to(x.dtype))
        return y * x_scale.to(x.dtype)[:, None] * self.scale.to(x.dtype)


class Fp8BlockWeight(QuantizedWeight):
    """W8A8 in blocks, as an HF fp8 checkpoint stores it (`weight_block_size` [128, 128]): e4m3
    codes [N, K] and a float32 scale per 128 x 128 block [ceil(N / 128), ceil(K / 128)] with
    w = q * scale; each call quantizes x per token and 128 columns.

    On Hopper, torch's block-scaled GEMM (F.scaled_mm, BlockWise1x128 activations against
    BlockWise128x128 weights, through cuBLASLt), and one row through the Triton GEMV on the same
    codes (x kept in 16 bits); elsewhere emulated: both dequantized, then a matmul in x's dtype
    (the reference the GPU path is tested against).
    """

    method = "fp8"

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__(torch.empty(codes.shape, dtype=dtype, device="meta"))
        self.qweight, self.scale = frozen(codes), frozen(scale.float())
        # torch's block-scaled GEMM runs on sm90 only; whole blocks keep it to one layout.
        self.scaled_mm = (
            codes.is_cuda
            and torch.cuda.get_device_capability(codes.device)[0] == 9
            and hasattr(F, "scaled_mm")
            and dtype == torch.bfloat16
            and self.in_features % FP8_BLOCK == 0
            and self.out_features % FP8_BLOCK == 0
        )
        if self.scaled_mm:
            # cuBLASLt reads the weight's scales with the K blocks padded to 4s: [N/128, Kb4],
            # passed transposed ([Kb4, N/128], column-major).
            self.register_buffer(
                "mm_scale", F.pad(scale, (0, -scale.shape[1] % 4)), persistent=False
            )
            from octavo.kernels import quant_gemm

            quant_gemm.prepare(codes.device)  # the GEMV's split-K counters, before any graph

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scaled_mm and x.numel() == self.in_features:
            from octavo.kernels.quant_gemm import fp8_gemv

            return fp8_gemv(x, self.qweight, self.scale, block_size=FP8_BLOCK)
        if self.scaled_mm:
            return self._scaled_mm(x)
        xq, x_scale = quantize_fp8_blocks(x, 1, FP8_BLOCK)  # [T, K] e4m3, [T, K/128]
        xd = dequantize_fp8_blocks(xq, x_scale, 1, FP8_BLOCK, x.dtype)
        w = dequantize_fp8_blocks(self.qweight, self.scale, FP8_BLOCK, FP8_BLOCK, x.dtype)
        return cpu_kernels.dense(xd, w)

    def _scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows % 4:  # cuBLASLt: the activations' scales, column-major, in whole 16 bytes
            x = F.pad(x, (0, 0, 0, -rows % 4))
        from octavo.kernels.quant_fp8 import per_group_quant_fp8

        xq, x_scale = per_group_quant_fp8(x, FP8_BLOCK, column_major_scales=True)
        y = F.scaled_mm(
            xq, self.qweight.t(),
            x_scale, F.ScalingType.BlockWise1x128,
            self.mm_scale.t(), F.ScalingType.BlockWise128x128,
            output_dtype=x.dtype,
        )  # fmt: skip
        return y[:rows]
