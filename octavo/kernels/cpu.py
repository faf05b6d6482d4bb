"""octavo's CPU kernels (cpu_kernels.c), built with the system's C compiler on first use.

Float32 products whose rows never depend on the batch (float32, 4-bit and 8-bit weights)
and causal attention over the paged float32 KV cache. The library is compiled for this
machine (`-march=native`) into octavo's cache and loaded with ctypes; the calls release
the GIL and run on torch's OpenMP threads, as many as torch.get_num_threads().
`library()` is None where no compiler is found or the build fails its self-check; the
callers then keep torch's own ops.

Weights come packed by `pack_weight`, a row of bytes for each output feature:

    F32  float32 [N, K], as the model holds it (no copy)
    Q4   per group of `group` columns a block: float32 scale, float32 min, then the codes
         0..15 in runs of 32 columns, 16 bytes a run (byte j = c[j] | c[j + 16] << 4)
    Q8   the same blocks with a byte a code
    with w = code * scale + min. Each row (and each thread's rows) is one stream of memory.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from octavo.cache import cache_root

_SOURCE = os.path.join(os.path.dirname(__file__), "cpu_kernels.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-shared", "-fPIC"]
W_F32, W_Q4, W_Q8 = 0, 1, 2
RUN = 32  # columns a Q4 run packs into 16 bytes; groups are whole runs


@dataclass(frozen=True)
class PackedWeight:
    """A weight [N, K] as cpu_kernels.c reads it (see the module docstring)."""

    kind: int
    out_features: int
    in_features: int
    data: torch.Tensor  # float32 [N, K], or uint8 [N, G * block bytes]
    group: int = RUN


def pack_weight(
    weight: torch.Tensor | None = None,
    codes: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    lo: torch.Tensor | None = None,
    in_features: int | None = None,
) -> PackedWeight:
    """A float32 `weight` [N, K] as it is, or `codes` uint8 [N, Kp] (Kp whole groups) with
    their groups' scale and min [N, G] (w = code * scale + min) in blocks: Q4 where every
    code is below 16, else Q8. `in_features`: the real K of padded codes (default Kp)."""
    if weight is not None:
        assert weight.dtype == torch.float32 and weight.dim() == 2
        return PackedWeight(W_F32, *weight.shape, weight.contiguous())
    assert codes is not None and scale is not None and lo is not None
    n, kp = codes.shape
    groups = scale.shape[1]
    group = kp // groups
    if group % RUN or kp % group:
        raise ValueError(f"group of {group} columns: the CPU kernels take multiples of {RUN}")
    codes = codes.to(torch.uint8)
    kind = W_Q4 if int(codes.max()) < 16 else W_Q8
    if kind == W_Q4:
        runs = codes.view(n, kp // RUN, 2, RUN // 2)
        codes = runs[:, :, 0] | (runs[:, :, 1] << 4)  # [N, Kp / 32, 16]
    header = torch.stack([scale.float(), lo.float()], dim=-1).view(torch.uint8)  # [N, G, 8]
    blocks = torch.cat([header, codes.reshape(n, groups, -1)], dim=-1)
    k = kp if in_features is None else in_features
    return PackedWeight(kind, n, k, blocks.reshape(n, -1).contiguous(), group)


def linear(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [T, K] float32 -> x W^T [T, N] float32, each row as it would be alone."""
    return _linear(x, w.kind, w.data, w.group, w.out_features, w.in_features)


def linear_dense(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] float32 -> x weight^T, weight float32 [N, K] (row-major), as `linear`."""
    y = _linear(x.reshape(-1, x.shape[-1]), W_F32, weight, RUN, *weight.shape)
    return y.view(*x.shape[:-1], weight.shape[0])


def _linear(x, kind, data, group, out_features, in_features) -> torch.Tensor:
    if x.stride(-1) != 1 or data.stride(-1) != 1:
        x, data = x.contiguous(), data.contiguous()
    rows = x.shape[0]
    y = torch.empty(rows, out_features, dtype=torch.float32)
    if rows:
        row_bytes = data.stride(0) * data.element_size()
        library().octavo_linear(
            kind, x.data_ptr(), x.stride(0), rows, in_features, data.data_ptr(), row_bytes,
            group, out_features, y.data_ptr(), out_features, torch.get_num_threads(),
        )  # fmt: skip
    return y


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b): float32 on the CPU runs `linear_dense`, whose rows never depend on how
    many share the call (torch's GEMMs round a row differently by the row count); anything
    else F.linear."""
    if x.is_cpu and x.dtype == weight.dtype and available(x.dtype):
        y = linear_dense(x, weight)
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


def compute_mode(
    device: torch.device,
    dtype: torch.dtype,
    kv_cache_dtype: torch.dtype,
    packed_weights: bool,
    head_dim: int,
) -> tuple[torch.dtype, bool]:
    """What a model's forward computes in: the dtype of its products' activations (torch's
    CPU kernels for packed weights round them to bfloat16), and whether a token's result is
    independent of the batch (float32 on the CPU through these kernels, attention included)."""
    ours = device.type == "cpu" and available(dtype)
    if device.type == "cpu" and packed_weights and not ours:
        return torch.bfloat16, False
    return dtype, ours and kv_cache_dtype == dtype and head_dim % 16 == 0 and head_dim <= 256


def available(dtype: torch.dtype) -> bool:
    """Whether products in `dtype` on the CPU run these kernels: float32, once built."""
    return dtype == torch.float32 and library() is not None


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    token_seq: torch.Tensor,
    token_ctx: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [T, H, D] float32; kv_cache [2, blocks, block_size, KVH, D] float32; block_tables
    [S, max_blocks] int32; token t of sequence token_seq[t] sees its first token_ctx[t]
    cached positions (int32 [T] each), the last `window` of them with a window -> out
    [T, H, D]. With `softcap` a score x is softcap * tanh(x / softcap) before the softmax."""
    lib = library()
    assert lib is not None
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    lib.octavo_paged_attention(
        q.data_ptr(), out.data_ptr(), num_tokens, num_heads, num_kv_heads, head_dim,
        kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), block_size,
        block_tables.data_ptr(), block_tables.stride(0), token_seq.data_ptr(),
        token_ctx.data_ptr(), ctypes.c_float(scale), window or 0, ctypes.c_float(softcap or 0.0),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def attention_supported(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether paged_attention takes these: float32 q and cache on the CPU, head_dim in 16s
    up to 256 (the torch backend serves as the GPU kernels' oracle too: it keeps SDPA
    there)."""
    return (
        q.is_cpu
        and kv_cache.is_cpu
        and q.dtype == kv_cache.dtype == torch.float32
        and available(torch.float32)
        and q.shape[-1] % 16 == 0
        and q.shape[-1] <= 256
        and kv_cache.is_contiguous()
    )


def dequantize(w: PackedWeight) -> torch.Tensor:
    """The float32 weight [N, K] a PackedWeight stands for."""
    if w.kind == W_F32:
        return w.data
    n = w.out_features
    blocks = w.data.view(n, -1, 8 + (w.group // 2 if w.kind == W_Q4 else w.group))
    scale, lo = blocks[:, :, :8].contiguous().view(torch.float32).unbind(-1)  # [N, G] each
    codes = blocks[:, :, 8:]
    if w.kind == W_Q4:
        runs = codes.reshape(n, -1, RUN // 2)
        codes = torch.cat([runs & 15, runs >> 4], dim=-1)
    per_col = functools.partial(torch.repeat_interleave, repeats=w.group, dim=1)
    deq = torch.addcmul(per_col(lo), codes.reshape(n, -1).float(), per_col(scale))
    return deq[:, : w.in_features]


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot be built or fail their self-check."""
    if os.environ.get("OCTAVO_CPU_KERNELS", "1") == "0":
        return None
    try:
        path = _build()
        lib = ctypes.CDLL(path)
    except (OSError, subprocess.SubprocessError) as e:
        print(f"octavo: CPU kernels unavailable ({e}); using torch's ops", file=sys.stderr)
        return None
    p, i, f, long_ = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long
    lib.octavo_linear.argtypes = [i, p, long_, i, i, p, long_, i, i, p, long_, i]
    lib.octavo_linear.restype = None
    lib.octavo_paged_attention.argtypes = [p, p, i, i, i, i, p, p, i, p, long_, p, p, f, i, f, i]
    lib.octavo_paged_attention.restype = None
    if lib.octavo_self_check() != 0:
        print("octavo: CPU kernels failed their self-check; using torch's ops", file=sys.stderr)
        return None
    return lib


def _build() -> str:
    """Compiles cpu_kernels.c for this machine once; returns the shared library's path."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc, gcc or $CC) found")
    with open(_SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(
        source + " ".join([compiler, *_FLAGS, platform.machine(), _cpu_flags()]).encode()
    ).hexdigest()[:16]
    root = cache_root()
    folder = os.path.join(root, "cpu_kernels") if root else tempfile.mkdtemp(prefix="octavo-")
    path = os.path.join(folder, f"cpu_kernels-{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    subprocess.run(
        [compiler, *_FLAGS, "-o", tmp, _SOURCE], check=True, capture_output=True, timeout=120
    )
    os.replace(tmp, path)  # atomic: processes building at once each land a whole file
    return path


def _cpu_flags() -> str:
    """This processor's feature flags (Linux), so a cache shared by machines keeps a build each."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""
