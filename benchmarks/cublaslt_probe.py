"""Decode-size projections: torch's cuBLAS call against every algorithm cuBLASLt offers.

`F.linear` on a bf16 weight takes cuBLAS's first heuristic choice for the shape. PyTorch's
TunableOp does not search further on CUDA (its only CUDA candidates are the cuBLAS and cuBLASLt
defaults), so no earlier session measured the other algorithms. This asks cuBLASLt's
heuristic for up to `--candidates` algorithms per shape, adds split-K variants of each
(`cublasLtMatmulAlgoCheck` decides which are valid), and times every one that computes the
same product, inside a CUDA graph over one distinct weight per layer (more bytes than L2
holds, as in a decode step).

cuBLASLt is reached through ctypes, from the libcublasLt that torch itself loaded.

    PYTHONPATH=. python benchmarks/cublaslt_probe.py [--models qwen3-0.6b,qwen3-8b] [--json F]
"""

from __future__ import annotations

import argparse
import ctypes
import json

import torch
import torch.nn.functional as F

from benchmarks.gemm_small import SHAPES  # (name, N, K): the four projections of a layer
from benchmarks.gemm_splitk import graph_us
from octavo.entrypoints.bench_floor import measure_ceilings

LAYERS = {"qwen3-0.6b": 28, "qwen3-8b": 36}
ROWS = [1, 8, 32, 64, 128, 256]
WORKSPACE = 32 << 20

# cublasLt.h / library_types.h constants
COMPUTE_32F, R_32F, R_16BF = 68, 0, 14
OP_N, OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB = 3, 4
PREF_MAX_WORKSPACE = 1
CFG = {"id": 0, "tile": 1, "splitk": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6,
       "inner": 7, "cluster": 8}  # fmt: skip
REDUCTION_INPLACE, REDUCTION_COMPUTE_TYPE = 1, 2


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]  # fmt: skip


def load_cublaslt() -> ctypes.CDLL:
    """The libcublasLt that torch has loaded (after one matmul), found in this process's maps."""
    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    torch.backends.cuda.preferred_blas_library("cublaslt")
    (a @ a).sum().item()
    torch.backends.cuda.preferred_blas_library("cublas")
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcublasLt" in line}
    if not paths:
        raise RuntimeError("libcublasLt is not loaded in this process")
    lib = ctypes.CDLL(min(paths))
    p, i, u64, i64, size = (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64,
                            ctypes.c_size_t)  # fmt: skip
    signatures = {
        "cublasLtCreate": [p],
        "cublasLtMatmulDescCreate": [p, i, i],
        "cublasLtMatmulDescSetAttribute": [p, i, p, size],
        "cublasLtMatrixLayoutCreate": [p, i, u64, u64, i64],
        "cublasLtMatmulPreferenceCreate": [p],
        "cublasLtMatmulPreferenceSetAttribute": [p, i, p, size],
        "cublasLtMatmulPreferenceDestroy": [p],
        "cublasLtMatmulAlgoGetHeuristic": [p, p, p, p, p, p, p, i, p, p],
        "cublasLtMatmulAlgoConfigGetAttribute": [p, i, p, size, p],
        "cublasLtMatmulAlgoConfigSetAttribute": [p, i, p, size],
        "cublasLtMatmulAlgoCheck": [p, p, p, p, p, p, p, p],
        "cublasLtMatmul": [p, p, p, p, p, p, p, p, p, p, p, p, p, p, size, p],
    }
    for name, argtypes in signatures.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = ctypes.c_int
    return lib


def check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what}: cuBLAS status {status}")


class LtGemm:
    """y = x @ w.T for one (M, N, K) in bf16 with fp32 accumulation, any cuBLASLt algorithm.

    Column-major view: y.T (N x M) = op(w) (N x K, from the row-major w read as K x N,
    transposed) times x.T (K x M).
    """

    def __init__(self, lib: ctypes.CDLL, handle, m: int, n: int, k: int) -> None:
        self.lib, self.handle, self.m, self.n, self.k = lib, handle, m, n, k
        self.desc = ctypes.c_void_p()
        check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), COMPUTE_32F, R_32F), "desc")
        for attr, op in ((DESC_TRANSA, OP_T), (DESC_TRANSB, OP_N)):
            v = ctypes.c_int32(op)
            check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), 4), "trans")
        self.a, self.b, self.d = (ctypes.c_void_p() for _ in range(3))
        for layout, rows, cols in ((self.a, k, n), (self.b, k, m), (self.d, n, m)):
            check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), R_16BF,
                                                 ctypes.c_uint64(rows), ctypes.c_uint64(cols),
                                                 ctypes.c_int64(rows)), "layout")  # fmt: skip
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")

    def heuristics(self, count: int) -> list[Heuristic]:
        pref = ctypes.c_void_p()
        check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
        ws = ctypes.c_uint64(WORKSPACE)
        check(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE,
                                                            ctypes.byref(ws), 8), "pref ws")  # fmt: skip
        results = (Heuristic * count)()
        got = ctypes.c_int(0)
        check(self.lib.cublasLtMatmulAlgoGetHeuristic(
            self.handle, self.desc, self.a, self.b, self.d, self.d, pref, count, results,
            ctypes.byref(got)), "heuristic")  # fmt: skip
        self.lib.cublasLtMatmulPreferenceDestroy(pref)
        return [results[i] for i in range(got.value) if results[i].state == 0]

    def config(self, algo: Algo) -> dict[str, int]:
        out = {}
        for name, attr in CFG.items():
            v, written = ctypes.c_uint32(0), ctypes.c_size_t(0)
            status = self.lib.cublasLtMatmulAlgoConfigGetAttribute(
                ctypes.byref(algo), attr, ctypes.byref(v), 4, ctypes.byref(written))
            out[name] = v.value if status == 0 else -1
        return out

    def variant(self, algo: Algo, splitk: int) -> Algo | None:
        """`algo` with `splitk` slices of K, if cuBLASLt accepts it for this problem."""
        new = Algo()
        ctypes.memmove(ctypes.byref(new), ctypes.byref(algo), ctypes.sizeof(Algo))
        for attr, value in ((CFG["splitk"], splitk),
                            (CFG["reduction"], REDUCTION_COMPUTE_TYPE if splitk > 1 else 0)):
            v = ctypes.c_uint32(value)
            if self.lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(new), attr,
                                                             ctypes.byref(v), 4) != 0:  # fmt: skip
                return None
        result = Heuristic()
        status = self.lib.cublasLtMatmulAlgoCheck(self.handle, self.desc, self.a, self.b,
                                                  self.d, self.d, ctypes.byref(new),
                                                  ctypes.byref(result))  # fmt: skip
        if status != 0 or result.workspace > WORKSPACE:
            return None
        return new

    def run(self, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, algo: Algo) -> int:
        return self.lib.cublasLtMatmul(
            self.handle, self.desc, ctypes.byref(self.alpha),
            ctypes.c_void_p(w.data_ptr()), self.a, ctypes.c_void_p(x.data_ptr()), self.b,
            ctypes.byref(self.beta), ctypes.c_void_p(y.data_ptr()), self.d,
            ctypes.c_void_p(y.data_ptr()), self.d, ctypes.byref(algo),
            ctypes.c_void_p(self.workspace.data_ptr()), ctypes.c_size_t(WORKSPACE),
            ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))  # fmt: skip


def candidates(gemm: LtGemm, count: int) -> list[tuple[Algo, dict[str, int]]]:
    out, seen = [], set()
    for h in gemm.heuristics(count):
        for splitk in (0, 2, 4, 8):
            algo = h.algo if splitk == 0 else gemm.variant(h.algo, splitk)
            if algo is None:
                continue
            cfg = gemm.config(algo)
            key = tuple(sorted(cfg.items()))
            if key not in seen:
                seen.add(key)
                out.append((algo, cfg))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="qwen3-0.6b,qwen3-8b")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--candidates", type=int, default=16)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    lib = load_cublaslt()
    handle = ctypes.c_void_p()
    check(lib.cublasLtCreate(ctypes.byref(handle)), "create")
    copy = measure_ceilings(torch.bfloat16).copy_bytes_per_s
    rows_m = [int(r) for r in args.rows.split(",")]
    rows = []
    print(f"{'model':<11}{'proj':<8}{'M':>4}{'floor':>7}{'torch':>8}{'lt #0':>8}{'best':>8}"
          f"{'tried':>6}  best config")  # fmt: skip
    for model in args.models.split(","):
        for name, n, k in SHAPES[model]:
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
                  for _ in range(LAYERS[model])]  # fmt: skip
            for m in rows_m:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = F.linear(x, ws[0]).float()
                torch_us = graph_us([lambda w=w: F.linear(x, w) for w in ws])  # noqa: B023
                gemm = LtGemm(lib, handle, m, n, k)
                ys = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in ws]
                timed = []
                for rank, (algo, cfg) in enumerate(candidates(gemm, args.candidates)):
                    if gemm.run(x, ws[0], ys[0], algo) != 0:
                        continue
                    err = ((ys[0].float() - ref).norm() / ref.norm()).item()
                    if err > 1e-2:
                        print(f"  {name} M={m} {cfg}: rel err {err:.3g}, skipped")
                        continue
                    t = graph_us([lambda w=w, y=y, a=algo: gemm.run(x, w, y, a)  # noqa: B023
                                  for w, y in zip(ws, ys)])  # fmt: skip
                    timed.append({"rank": rank, "us": t, **cfg})
                first = timed[0]["us"] if timed else float("nan")
                best = min(timed, key=lambda r: r["us"]) if timed else {"us": float("nan")}
                floor = n * k * 2 / copy * 1e6
                rows.append({"model": model, "proj": name, "m": m, "n": n, "k": k,
                             "floor_us": floor, "torch_us": torch_us, "lt_first_us": first,
                             "best": best, "tried": timed})  # fmt: skip
                cfg_s = " ".join(f"{a}={b}" for a, b in best.items() if a != "us")
                print(f"{model:<11}{name:<8}{m:>4}{floor:>7.1f}{torch_us:>8.1f}{first:>8.1f}"
                      f"{best['us']:>8.1f}{len(timed):>6}  {cfg_s}", flush=True)  # fmt: skip
            del ws
    print("a layer's four projections, us: floor / torch / best cuBLASLt algorithm")
    for model in args.models.split(","):
        for m in rows_m:
            sel = [r for r in rows if r["model"] == model and r["m"] == m]
            f_, t_ = (sum(r[key] for r in sel) for key in ("floor_us", "torch_us"))
            b_ = sum(r["best"]["us"] for r in sel)
            print(f"{model} M={m:>3}: {f_:7.1f} / {t_:7.1f} / {b_:7.1f}  "
                  f"({(t_ - b_) * LAYERS[model] / 1e3:.3f} ms a step)")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bytes_per_s": copy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
