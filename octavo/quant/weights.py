"""Linear weights quantized on load by round-to-nearest, and y = x W^T through them.

    int8  int8 weights, one scale per output row (symmetric); activations in the model's dtype.
    int4  4-bit weights in groups of GROUP_SIZE input columns, each with a scale and a
          minimum (asymmetric, as GGUF's Q4_1 and AWQ): w ~ q * scale + min, q in 0..15.
    fp8   W8A8: e4m3 weights with one scale per output row, and activations quantized to e4m3
          with one scale per token at each call (one row on Hopper: W8A16, a Triton GEMV).
          An HF fp8 checkpoint keeps its own e4m3 weights and its scale per 128 x 128 block
          (Fp8BlockWeight); its activations take a scale per token and 128 columns.
    gguf  a GGUF file's Q4_0/Q4_1/Q4_K blocks kept as int4 on the file's groups of 32, its
          Q8_0 ones as 8-bit codes (Q8Weight); awq, gptq: a checkpoint's 4-bit groups.

Each method is a `QuantizedWeight` module that a `Linear` (model/layers.py) holds in place of
its float weight, built from the shard this rank loaded (quant/rounding.py holds the
quantizers and their references). Where the products run: on the CPU, float32 models in
octavo's C kernel (kernels/cpu.py), 16-bit ones in torch's weight-packed kernels
(quant/cpu_packing.py); on CUDA with 16-bit weights, octavo's Triton GEMMs
(kernels/quant_gemm.py), fp8 torch._scaled_mm on Hopper; elsewhere the dequantized weight
(fp8 emulated: activations to e4m3 and back, then a matmul).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from octavo.kernels import cpu as cpu_kernels
from octavo.quant.cpu_packing import (
    pack_int4_for_torch,
    pack_int8_for_octavo,
    q8_planes,
    scale_zero,
)
from octavo.quant.rounding import (
    FP8_BLOCK,
    dequantize_fp8_blocks,
    dequantize_int4,
    dequantize_int8,
    quantize_fp8,
    quantize_fp8_blocks,
    quantize_int4,
    quantize_int8,
)

GROUP_SIZE = 128
# Up to this many rows the CPU's int8 kernel beats dequantizing the weight for one float GEMM.
INT8_KERNEL_MAX_ROWS = 64
# Whether the CPU runs quantized products in packed kernels, octavo's or torch's (the tests
# turn them off to check the dequantize-then-matmul paths that other devices take).
CPU_KERNELS = hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(
    torch, "_weight_int8pack_mm"
)


def quantize_weight(method: str, weight: torch.Tensor) -> QuantizedWeight:
    """weight [N, K] (output rows, input columns) -> its `method` quantization."""
    classes = {"int8": Int8Weight, "int4": Int4Weight, "fp8": Fp8Weight}
    if method not in classes:  # gguf, awq, gptq: a checkpoint's own groups (Int4Weight's grid)
        raise ValueError(
            f"quantization={method!r} cannot quantize float weights (gguf, awq and gptq keep a "
            f"checkpoint's own 4-bit groups); use one of {tuple(classes)}"
        )
    return classes[method](weight)


def _frozen(t: torch.Tensor) -> nn.Parameter:
    """A parameter, so that the weight counts among the model's (e.g. in memory floors)."""
    return nn.Parameter(t, requires_grad=False)


def _uses_cpu_kernels(device: torch.device) -> bool:
    return device.type == "cpu" and CPU_KERNELS


def _uses_gpu_kernels(
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
        self.cpu_kernel = _uses_cpu_kernels(weight.device)
        self.gpu_kernel = _uses_gpu_kernels(weight.device, weight.dtype)
        self.packed = None
        if self.cpu_kernel and cpu_kernels.available(weight.dtype):
            q, scale = quantize_int8(weight, torch.float32)
            self.packed = pack_int8_for_octavo(q, scale)
            self.qweight = _frozen(self.packed.data)
            return
        q, scale = quantize_int8(weight, torch.bfloat16 if self.cpu_kernel else weight.dtype)
        if self.gpu_kernel:
            from octavo.kernels.quant_gemm import pack_int8

            q = pack_int8(q)  # int32 [N, Kp / 4]
        self.qweight, self.scale = _frozen(q), _frozen(scale)

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
        self.cpu_kernel = _uses_cpu_kernels(device)
        self.gpu_kernel = _uses_gpu_kernels(device, weight.dtype, group_size)
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
            self.qweight = _frozen(self.packed.data)  # codes with their scales and minimums
        elif self.cpu_kernel:
            packed, scale_zero = pack_int4_for_torch(q, scale, lo)
            self.qweight, self.qscale_zero = _frozen(packed), _frozen(scale_zero)
        elif self.gpu_kernel:
            from octavo.kernels.quant_gemm import pack_int4

            self.qweight = _frozen(pack_int4(q, group_size))  # int32 [N, Kp / 8]
            self.scale, self.min = _frozen(scale), _frozen(lo)
        else:
            self.qweight = _frozen(q[:, 0::2] | (q[:, 1::2] << 4))  # [N, Kp / 2]
            self.scale, self.min = _frozen(scale), _frozen(lo)

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


class Q8Weight(QuantizedWeight):
    """8-bit codes u [N, K] (uint8) with a scale and a minimum per group of 32 columns
    [N, G]: w = u * scale + min. GGUF's Q8_0 (int8 c with a scale d) is u = c + 128 with
    min -128 d; a 4-bit group (Q4_0, Q4_1, Q4_K) is one whose codes stay below 16.

    On the CPU it runs torch's int4 kernel twice: u is 16 h + l with h, l in 0..15, so the
    product is that of h (scale 16 s, min m) plus that of l (scale s): two 4-bit planes
    that read as many bytes as the 8-bit codes. Elsewhere it dequantizes."""

    method = "gguf"

    def __init__(
        self, codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, dtype: torch.dtype
    ) -> None:
        super().__init__(torch.empty(codes.shape, dtype=dtype, device="meta"))
        self.cpu_kernel = Q8Weight.runs_kernel(codes.device, codes.shape[0], dtype)
        self.packed = None
        if self.cpu_kernel and cpu_kernels.available(dtype):
            self.packed = cpu_kernels.pack_weight(codes=codes, scale=scale, lo=lo)
            self.codes = _frozen(self.packed.data)  # codes with their scales and minimums
        elif self.cpu_kernel:
            s, m = scale.to(torch.bfloat16), lo.to(torch.bfloat16)
            # The minimum joins the plane where the kernel's bfloat16 zero stays exact: the
            # high one for Q8_0's -128 s (its zero is then 0), else the low one (a 4-bit
            # group's zero is then Int4Weight's).
            m_high = torch.where(m == -128 * s, m, torch.zeros_like(m))
            self.high, self.low = map(_frozen, q8_planes(codes))
            self.high_scale_zero = _frozen(scale_zero(16 * s, m_high))  # 16 s h (+ m)
            self.low_scale_zero = _frozen(scale_zero(s, m - m_high))  # s l (+ m)
        else:
            self.codes = _frozen(codes)
            self.scale, self.min = _frozen(scale.to(dtype)), _frozen(lo.to(dtype))

    @staticmethod
    def runs_kernel(device: torch.device, rows: int, dtype: torch.dtype) -> bool:
        """Whether codes of `rows` rows on `device` run a CPU kernel (else each product
        dequantizes): octavo's for float32, torch's for 16-bit rows in 16s."""
        return _uses_cpu_kernels(device) and (rows % 16 == 0 or cpu_kernels.available(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return cpu_kernels.linear(x, self.packed)
        if self.cpu_kernel:
            x16 = x.to(torch.bfloat16)
            y = torch._weight_int4pack_mm_for_cpu(x16, self.high, 32, self.high_scale_zero)
            y = y.float() + torch._weight_int4pack_mm_for_cpu(
                x16, self.low, 32, self.low_scale_zero
            )
            return y.to(x.dtype)
        return cpu_kernels.dense(
            x, dequantize_int4(self.codes, self.scale, self.min, self.in_features, x.dtype)
        )


class GroupRows(nn.Module):
    """An embedding table kept as codes u [V, H] (uint8) with a scale and a minimum per group
    of 32 columns [V, H / 32] (float32): w = u * scale + min, as in Q8Weight. A lookup
    dequantizes only the rows it reads, in float32 and then `dtype`: a GGUF file's token
    embedding stays in its blocks, as vLLM keeps it."""

    def __init__(
        self, codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.dtype = dtype
        self.codes, self.scale, self.min = _frozen(codes), _frozen(scale), _frozen(lo)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> rows [T, H] in `dtype`."""
        codes, scale, lo = self.codes[ids], self.scale[ids], self.min[ids]
        return dequantize_int4(codes, scale, lo, codes.shape[1], torch.float32).to(self.dtype)


class Fp8Weight(QuantizedWeight):
    """W8A8: e4m3 [N, K] and a float32 scale per row; each call quantizes x per token."""

    method = "fp8"

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight)
        q, scale = quantize_fp8(weight)
        self.qweight, self.scale = _frozen(q), _frozen(scale)
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
        self.qweight, self.scale = _frozen(codes), _frozen(scale.float())
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
