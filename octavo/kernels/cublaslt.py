"""One projection y = x @ w.T through cuBLASLt, with an algorithm of our choosing.

torch's `F.linear` runs cuBLAS's first heuristic pick for the shape, and at a few rows another
candidate can be much faster (see docs/PERFORMANCE.md). `runner/gemm_tuning.py` times the
candidates at start-up and keeps the winners; this file only binds the C API, through ctypes,
to the libcublasLt that torch has loaded.

Column-major view of the row-major tensors (cuBLAS's convention):

    x [M, K] row-major = x^T [K, M] column-major     (B, not transposed)
    w [N, K] row-major = w^T [K, N] column-major     (A, transposed: op(A) = w [N, K])
    y [M, N] row-major = y^T [N, M] column-major     (D = op(A) @ B)
"""

from __future__ import annotations

import ctypes
import functools
import os
import weakref

import torch

# cublasLt.h and library_types.h
_COMPUTE_32F, _R_32F = 68, 0
_DATA_TYPES = {torch.bfloat16: 14, torch.float16: 2}
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_PREF_MAX_WORKSPACE_BYTES = 1
_CONFIG_SPLITK_NUM, _CONFIG_REDUCTION_SCHEME = 2, 3
_REDUCTION_COMPUTE_TYPE = 2

WORKSPACE_BYTES = 32 << 20
SUPPORTED_DTYPES = tuple(_DATA_TYPES)
ALIGNMENT = 256  # bytes: the pointer alignment cuBLASLt's heuristic assumes by default


def aligned(t: torch.Tensor) -> bool:
    """True if `t`'s data starts on the alignment the chosen algorithms may rely on."""
    return t.data_ptr() % ALIGNMENT == 0


class Algo(ctypes.Structure):
    """cublasLtMatmulAlgo_t: opaque, 8 x uint64."""

    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t."""

    _fields_ = [
        ("algo", Algo),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves_count", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


@functools.cache
def library() -> ctypes.CDLL:
    """The libcublasLt in this process (torch's own), with the signatures this file uses.

    Raises:
        RuntimeError: no CUDA, or no libcublasLt mapped into the process (not Linux).
    """
    if not torch.cuda.is_available():
        raise RuntimeError("cuBLASLt needs CUDA")
    a = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()  # cuBLAS, and with it cuBLASLt, is loaded on first use
    try:
        with open("/proc/self/maps") as f:  # address perms offset dev inode [path]
            fields = (line.rstrip("\n").split(maxsplit=5) for line in f)
            paths = {m[5].removesuffix(" (deleted)") for m in fields if len(m) == 6}
    except OSError as e:
        raise RuntimeError(f"cannot list this process's libraries: {e}") from e
    paths = {path for path in paths if "libcublasLt.so" in os.path.basename(path)}
    if not paths:
        raise RuntimeError("libcublasLt is not loaded in this process")
    try:
        return _bind(ctypes.CDLL(min(paths)))
    except (OSError, AttributeError) as e:  # not loadable, or a symbol missing
        raise RuntimeError(f"cannot use {min(paths)}: {e}") from e


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i, size = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    signatures = {
        "cublasLtCreate": [p],
        "cublasLtMatmulDescCreate": [p, i, i],
        "cublasLtMatmulDescSetAttribute": [p, i, p, size],
        "cublasLtMatmulDescDestroy": [p],
        "cublasLtMatrixLayoutCreate": [p, i, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64],
        "cublasLtMatrixLayoutDestroy": [p],
        "cublasLtMatmulPreferenceCreate": [p],
        "cublasLtMatmulPreferenceSetAttribute": [p, i, p, size],
        "cublasLtMatmulPreferenceDestroy": [p],
        "cublasLtMatmulAlgoGetHeuristic": [p, p, p, p, p, p, p, i, p, p],
        "cublasLtMatmulAlgoConfigSetAttribute": [p, i, p, size],
        "cublasLtMatmulAlgoCheck": [p, p, p, p, p, p, p, p],
        "cublasLtMatmul": [p, p, p, p, p, p, p, p, p, p, p, p, p, p, size, p],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    lib.cublasLtGetVersion.argtypes, lib.cublasLtGetVersion.restype = [], ctypes.c_size_t
    return lib


def version() -> int:
    """cuBLASLt's version number (an algorithm saved under one version is only valid for it)."""
    return library().cublasLtGetVersion()


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} failed with status {status}")


@functools.cache
def _handle() -> ctypes.c_void_p:
    handle = ctypes.c_void_p()
    _check(library().cublasLtCreate(ctypes.byref(handle)), "create")
    return handle


@functools.cache
def _workspace(device_index: int) -> torch.Tensor:
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device_index}")


def _destroy(desc: ctypes.c_void_p, *layouts: ctypes.c_void_p) -> None:
    lib = library()
    lib.cublasLtMatmulDescDestroy(desc)
    for layout in layouts:
        lib.cublasLtMatrixLayoutDestroy(layout)


class LtGemm:
    """y [M, N] = x [M, K] @ w [N, K]^T for one (M, N, K, dtype), fp32 accumulation.

    Args:
        m, n, k: rows of x, rows of w, the shared inner size.
        dtype: of x, w and y (bfloat16 or float16).
    """

    def __init__(self, m: int, n: int, k: int, dtype: torch.dtype) -> None:
        self.m, self.n, self.k, self.dtype = m, n, k, dtype
        lib = library()
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _R_32F), "desc")
        for attr, op in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N)):
            value = ctypes.c_int32(op)
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value), 4),
                   "desc attribute")  # fmt: skip
        self.a, self.b, self.d = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        for layout, rows, cols in ((self.a, k, n), (self.b, k, m), (self.d, n, m)):
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), _DATA_TYPES[dtype],
                                                  rows, cols, rows), "layout")  # fmt: skip
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        # The descriptors go with the object (a CUDA graph that captured a call keeps its own
        # copy of the launch, so destroying them later is safe).
        self.release = weakref.finalize(self, _destroy, self.desc, self.a, self.b, self.d)

    def candidates(self, count: int, splits: tuple[int, ...] = (1, 2, 4, 8)) -> list[Algo]:
        """cuBLASLt's first `count` heuristic algorithms, each also with K split into each of
        `splits` (the variants cuBLASLt accepts for this problem)."""
        lib = library()
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        limit = ctypes.c_uint64(WORKSPACE_BYTES)
        try:
            _check(lib.cublasLtMatmulPreferenceSetAttribute(
                pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(limit), 8), "preference")  # fmt: skip
            results = (_Heuristic * count)()
            found = ctypes.c_int(0)
            _check(lib.cublasLtMatmulAlgoGetHeuristic(
                _handle(), self.desc, self.a, self.b, self.d, self.d, pref, count, results,
                ctypes.byref(found)), "heuristic")  # fmt: skip
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        out, seen = [], set()
        for result in results[: found.value]:
            if result.state != 0:
                continue
            for split in splits:
                algo = self._with_split(result.algo, split)
                if algo is not None and bytes(algo) not in seen:
                    seen.add(bytes(algo))
                    out.append(algo)
        return out

    def _with_split(self, algo: Algo, split: int) -> Algo | None:
        lib = library()
        new = Algo.from_buffer_copy(algo)
        if split > 1:
            for attr, value in ((_CONFIG_SPLITK_NUM, split),
                                (_CONFIG_REDUCTION_SCHEME, _REDUCTION_COMPUTE_TYPE)):  # fmt: skip
                v = ctypes.c_uint32(value)
                if lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(new), attr,
                                                            ctypes.byref(v), 4) != 0:  # fmt: skip
                    return None
        return new if self.accepts(new) else None

    def accepts(self, algo: Algo) -> bool:
        """True if `algo` can run this GEMM within the workspace (cublasLtMatmulAlgoCheck)."""
        result = _Heuristic()
        status = library().cublasLtMatmulAlgoCheck(
            _handle(), self.desc, self.a, self.b, self.d, self.d, ctypes.byref(algo),
            ctypes.byref(result))  # fmt: skip
        return status == 0 and result.workspace_size <= WORKSPACE_BYTES

    def __call__(self, x: torch.Tensor, w: torch.Tensor, algo: Algo) -> torch.Tensor:
        """x [M, K] @ w [N, K]^T with `algo`, on the current stream (CUDA-graph safe).

        NOTE: x and w must be contiguous, of this GEMM's shape and dtype, and 256-byte
        aligned (what cuBLASLt's heuristic assumes by default); not checked here: the
        caller dispatches on `aligned`.
        """
        y = torch.empty(self.m, self.n, dtype=self.dtype, device=x.device)
        _check(library().cublasLtMatmul(
            _handle(), self.desc, ctypes.byref(self.alpha), w.data_ptr(), self.a,
            x.data_ptr(), self.b, ctypes.byref(self.beta), y.data_ptr(), self.d,
            y.data_ptr(), self.d, ctypes.byref(algo),
            _workspace(x.device.index or 0).data_ptr(), WORKSPACE_BYTES,
            torch.cuda.current_stream(x.device).cuda_stream), "matmul")  # fmt: skip
        return y
