"""QuantizedWeight: the module a Linear holds in place of its float weight, computing
y = x W^T; and the two 4/8-bit integer forms most methods keep (fp8's are quant/fp8.py's,
GGUF's Q8_0 quant/gguf.py's).

    Int8Weight  int8, one scale per output row (symmetric): quantization="int8".
    Int4Weight  4-bit codes in groups of input columns, each group with a scale and a minimum:
                w = q * scale + min, q in 0..15 (asymmetric, as GGUF's Q4_1 and AWQ). Rounded
                to nearest (quantization="int4", groups of GROUP_SIZE), or a checkpoint's own
                codes and groups (gguf, awq, gptq).

Where the products run: on the CPU, float32 models in octavo's C kernel (kernels/cpu.py),
16-bit ones in torch's weight-packed kernels (quant/cpu_packing.py); on CUDA with 16-bit
weights, octavo's Triton GEMMs (kernels/quant_gemm.py); elsewhere the dequantized weight
(quant/rounding.py holds the quantizers and their references).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from octavo.kernels import cpu as cpu_kernels
from octavo.quant.cpu_packing import pack_int4_for_torch, pack_int8_for_octavo
from octavo.quant.rounding import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8

GROUP_SIZE = 128
# Up to this many rows the CPU's int8 kernel beats dequantizing the weight for one float GEMM.
INT8_KERNEL_MAX_ROWS = 64
# Whether the CPU runs quantized products in packed kernels, octavo's or torch's (the tests
# turn them off to check the dequantize-then-matmul paths that other devices take).
CPU_KERNELS = hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(
    torch, "_weight_int8pack_mm"
)


def frozen(t: torch.Tensor) -> nn.Parameter:
    """A parameter, so that the weight counts among the model's (e.g. in memory floors)."""
    return nn.Parameter(t, requires_grad=False)


def uses_cpu_kernels(device: torch.device) -> bool:
    return device.type == "cpu" and CPU_KERNELS


def uses_gpu_kernels(
    device: torch.device, dtype: torch.dtype, group_size: int | None = None
) -> bool:
    """Whether the product runs kernels/quant_gemm.py's Triton GEMMs: on CUDA with 16-bit
    weights (and an int4 group size they take). Readies their split-K counters on that
    device, before any CUDA graph captures them."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    from octavo.kernels import quant_gemm

    quant_gemm.prepare(device)
    sizes = quant_gemm.INT4_GROUP_SIZES
    return group_size is None or group_size in sizes or group_size % sizes[-1] == 0


class QuantizedWeight(nn.Module):
    """A quantized weight [N, K] and its product: forward(x [T, K]) -> x W^T [T, N] in x's
    dtype. `dtype` is the float dtype the weight had (and the activations have)."""

    method: str

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype


class Int8Weight(QuantizedWeight):
    """W8A16: int8 [N, K] and a scale per row. On the CPU, bfloat16 scales for torch's kernel;
    on CUDA the codes packed four a word for the Triton kernels (quant_gemm.pack_int8)."""

    method = "int8"

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight)
        self.cpu_kernel = uses_cpu_kernels(weight.device)
        self.gpu_kernel = uses_gpu_kernels(weight.device, weight.dtype)
        self.packed = None
        if self.cpu_kernel and cpu_kernels.available(weight.dtype):
            q, scale = quantize_int8(weight, torch.float32)
            self.packed = pack_int8_for_octavo(q, scale)
            self.qweight = frozen(self.packed.data)
            return
        q, scale = quantize_int8(weight, torch.bfloat16 if self.cpu_kernel else weight.dtype)
        if self.gpu_kernel:
            from octavo.kernels.quant_gemm import pack_int8

            q = pack_int8(q)  # int32 [N, Kp / 4]
        self.qweight, self.scale = frozen(q), frozen(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return cpu_kernels.linear(x, self.packed)
        if self.gpu_kernel:
            from octavo.kernels.quant_gemm import int8_linear

            return int8_linear(x.to(self.dtype), self.qweight, self.scale).to(x.dtype)
        if self.cpu_kernel and x.shape[0] <= INT8_KERNEL_MAX_ROWS:
            y = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scale)
            return y.to(x.dtype)
        return cpu_kernels.dense(x, dequantize_int8(self.qweight, self.scale, x.dtype))


class Int4Weight(QuantizedWeight):
    """W4A16, group GROUP_SIZE. On the CPU the weight is in the layout of torch's int4 kernel
    (`qscale_zero` [G, N, 2], its zero being min + 8 * scale); on CUDA eight codes a word for
    the Triton kernels (quant_gemm.pack_int4) with `scale` and `min` [N, G]; elsewhere two
    values a byte (low nibble first) with `scale` and `min`, dequantized for each product.
    `columns` (GPTQ's act order): x's columns in the order of the weight's, or None."""

    method = "int4"

    def __init__(
        self,
        weight: torch.Tensor,
        group_size: int = GROUP_SIZE,
        grid: tuple[torch.Tensor, torch.Tensor] | None = None,
        columns: torch.Tensor | None = None,
        codes: torch.Tensor | None = None,
    ) -> None:
        """Quantizes `weight` (round to nearest), or keeps a checkpoint's own 4-bit weight:
        its `codes` uint8 [N, K] in 0..15 on `grid`, the (scale, min) [N, K / group_size]
        with w = code * scale + min (a GGUF file's or an AWQ/GPTQ checkpoint's); `weight` is
        then not read, only its shape and dtype (it may be on the meta device; the codes'
        device is the weight's). columns [K]: the input column each of the weight's columns
        takes (forward permutes x so), or None for all in order."""
        super().__init__(weight)
        self.register_buffer("columns", columns)
        self.group_size = group_size
        device = weight.device if codes is None else codes.device
        self.cpu_kernel = uses_cpu_kernels(device)
        self.gpu_kernel = uses_gpu_kernels(device, weight.dtype, group_size)
        # float32 on the CPU: octavo's kernel, float32 throughout; else torch's, in bfloat16.
        octavo_cpu = self.cpu_kernel and cpu_kernels.available(weight.dtype)
        self.packed = None
        param_dtype = torch.bfloat16 if self.cpu_kernel and not octavo_cpu else weight.dtype
        if codes is None:
            q, scale, lo = quantize_int4(weight, group_size, param_dtype)
        else:
            assert grid is not None and codes.shape == weight.shape and codes.dtype == torch.uint8
            q, scale, lo = codes, grid[0].to(param_dtype), grid[1].to(param_dtype)
        self.padded_in_features = q.shape[1]
        if self.gpu_kernel and group_size > 128:  # the kernels' largest: runs of 128
            runs = group_size // 128
            scale, lo = scale.repeat_interleave(runs, 1), lo.repeat_interleave(runs, 1)
            self.group_size = group_size = 128
        if octavo_cpu:
            self.packed = cpu_kernels.pack_weight(
                codes=q, scale=scale, lo=lo, in_features=self.in_features
            )
            self.qweight = frozen(self.packed.data)  # codes with their scales and minimums
        elif self.cpu_kernel:
            packed, scale_zero = pack_int4_for_torch(q, scale, lo)
            self.qweight, self.qscale_zero = frozen(packed), frozen(scale_zero)
        elif self.gpu_kernel:
            from octavo.kernels.quant_gemm import pack_int4

            self.qweight = frozen(pack_int4(q, group_size))  # int32 [N, Kp / 8]
            self.scale, self.min = frozen(scale), frozen(lo)
        else:
            self.qweight = frozen(q[:, 0::2] | (q[:, 1::2] << 4))  # [N, Kp / 2]
            self.scale, self.min = frozen(scale), frozen(lo)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.columns is not None:
            x = x.index_select(-1, self.columns)
        if self.packed is not None:
            return cpu_kernels.linear(x, self.packed)
        if self.cpu_kernel:
            x16 = x.to(torch.bfloat16)
            if self.padded_in_features != self.in_features:  # K ends inside a group
                x16 = F.pad(x16, (0, self.padded_in_features - self.in_features))
            y = torch._weight_int4pack_mm_for_cpu(
                x16, self.qweight, self.group_size, self.qscale_zero
            )
            return y.to(x.dtype)
        if self.gpu_kernel:
            from octavo.kernels.quant_gemm import int4_linear

            y = int4_linear(x.to(self.dtype), self.qweight, self.scale, self.min, self.group_size)
            return y.to(x.dtype)
        packed = self.qweight
        q = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(packed.shape[0], -1)
        w = dequantize_int4(q, self.scale, self.min, self.in_features, x.dtype)
        return cpu_kernels.dense(x, w)
