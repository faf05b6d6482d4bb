"""Four fixes to Triton 3.6's CPU interpreter, applied only when TRITON_INTERPRET=1.

1. Scalars are 1-element arrays there, and `range(0, n)` over a loaded scalar calls `int()` on
   them, which NumPy >= 2.4 refuses ("only 0-dimensional arrays can be converted").
2. `tl.dot` on bfloat16 runs np.matmul over the raw 16-bit integers (NumPy has no bfloat16),
   which returns garbage; widen bfloat16 operands first (exact), and sum in float64 rounded
   once to float32: BLAS's float32 kernels round a row differently by its place in the
   tile, which a tensor core does not (tests/gpu/test_fixed_order.py compares bits).
3. Rounding float32 to float8e4nv drops the carry out of the mantissa (31.5 becomes 16, not
   32) and rounds ties away from even; round through torch's float8_e4m3fn instead (to
   nearest even, as the GPU's conversion). Widening fp8 is exact there already.
4. Casting float32 to bfloat16 truncates; round through torch's bfloat16 instead (to nearest
   even, as the GPU's cvt.rn).

Neither changes what a kernel computes on the GPU; they let the same kernels run on the CPU.
"""

from __future__ import annotations

import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter


def _bf16_to_f32(data: np.ndarray) -> np.ndarray:
    return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def apply() -> None:
    """Patches the interpreter in place; calling it twice is harmless."""
    if getattr(interpreter, "_octavo_patched", False):
        return
    original_patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor(tensor, scope):
        original_patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_tensor

    builder_cls = interpreter.InterpreterBuilder
    original_dot = builder_cls.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype == tl.bfloat16 or b.dtype == tl.bfloat16:
            a_data = _bf16_to_f32(a.data) if a.dtype == tl.bfloat16 else a.data
            b_data = _bf16_to_f32(b.data) if b.dtype == tl.bfloat16 else b.data
            out = np.matmul(a_data.astype(np.float64), b_data.astype(np.float64)) + d.data
            out = out.astype(d.data.dtype)
            return interpreter.TensorHandle(out, d.dtype.scalar)
        return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder_cls.create_dot = create_dot

    original_fp_to_fp = builder_cls.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            e4m3 = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.float8_e4m3fn)
            return interpreter.TensorHandle(e4m3.view(torch.uint8).numpy(), dst_type.scalar)
        return original_fp_to_fp(self, src, dst_type, rounding_mode)

    builder_cls.create_fp_to_fp = create_fp_to_fp

    original_cast = builder_cls.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bf16 = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return interpreter.TensorHandle(bf16.view(torch.int16).numpy().view(np.uint16),
                                            tl.bfloat16)  # fmt: skip
        return original_cast(self, src, dst_type)

    builder_cls.cast_impl = cast_impl
    interpreter._octavo_patched = True
