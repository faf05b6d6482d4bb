"""Decode-size linear layers: cuBLAS (torch.nn.functional.linear) against a plain tiled
Triton GEMM (`skinny_gemm` below) over a small sweep of its tiles, at the Qwen3-0.6B and
Qwen3-8B shapes, with the weight-read floor (weight bytes / copy bandwidth). L2 is flushed
before every run, as in a decode step where attention has streamed gigabytes through it.

An experiment, kept with its result (docs/PERFORMANCE.md): the Triton kernel only ties
cuBLAS up to 64 rows and loses above, so the engine keeps cuBLAS.

    PYTHONPATH=. python benchmarks/gemm_small.py [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.runtime.errors
import triton.testing

from octavo.entrypoints.bench_floor import measure_ceilings


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,  # [M, K], K contiguous
    w_ptr,  # [N, K], K contiguous
    b_ptr,  # [N] (read only if HAS_BIAS)
    y_ptr,  # [M, N], contiguous
    M,
    N,
    K,
    stride_x,
    stride_w,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_x + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = (offs_k + k) < K
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


MAX_ROWS = 256  # the largest M this kernel is meant for


def default_config(m: int, n: int, k: int) -> dict[str, int]:
    """Tiles by the row count: one row block up to 64 rows, blocks of 128 above."""
    block_m = max(16, min(triton.next_power_of_2(m), 128))
    return {"block_m": block_m, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4}


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias) -> [M, N] in x's dtype, fp32 accumulation.

    Raises ValueError for mismatched shapes or a non-contiguous last dim.
    """
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"skinny_gemm: x {tuple(x.shape)} and weight {tuple(weight.shape)}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    cfg = config or default_config(m, n, k)
    grid = (triton.cdiv(n, cfg["block_n"]), triton.cdiv(m, cfg["block_m"]))
    _skinny_gemm_kernel[grid](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0),
        weight.stride(0), HAS_BIAS=bias is not None, BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )  # fmt: skip
    return y


# (name, N, K): the four projections of a layer
SHAPES = {
    "qwen3-0.6b": [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024),
                   ("down", 1024, 3072)],
    "qwen3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096),
                 ("down", 4096, 12288)],
}  # fmt: skip
ROWS = [1, 32, 64, 128, 256]


def configs(m: int) -> list[dict[str, int]]:
    base = default_config(m, 0, 0)
    out = []
    for block_n, block_k, stages in itertools.product([32, 64, 128], [128, 256], [3, 4]):
        out.append(base | {"block_n": block_n, "block_k": block_k, "num_stages": stages})
    return out


def us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median") * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    copy = measure_ceilings(torch.bfloat16).copy_bytes_per_s
    rows = []
    print(
        f"{'model':<11}{'proj':<8}{'M':>4}{'floor us':>9}{'cublas':>8}{'Lt':>8}{'triton':>8}"
        f"{'default':>8}  best config"
    )
    for model, shapes in SHAPES.items():
        for (name, n, k), m in itertools.product(shapes, ROWS):
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, w)
            cublas = us(lambda: F.linear(x, w))  # noqa: B023
            torch.backends.cuda.preferred_blas_library("cublaslt")
            cublaslt = us(lambda: F.linear(x, w))  # noqa: B023
            torch.backends.cuda.preferred_blas_library("default")
            timed = []
            for cfg in configs(m):
                try:
                    got = skinny_gemm(x, w, config=cfg)
                except triton.runtime.errors.OutOfResources:
                    continue  # tiles too large for shared memory
                err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                if err > 1e-2:
                    raise AssertionError(f"{model} {name} M={m} {cfg}: rel err {err}")
                timed.append((us(lambda: skinny_gemm(x, w, config=cfg)), cfg))  # noqa: B023
            best_us, best = min(timed, key=lambda t: t[0])
            default_us = us(lambda: skinny_gemm(x, w))  # noqa: B023
            floor = n * k * 2 / copy * 1e6
            rows.append({"model": model, "proj": name, "m": m, "n": n, "k": k, "floor_us": floor,
                         "cublas_us": cublas, "cublaslt_us": cublaslt, "triton_best_us": best_us, "best": best,
                         "triton_default_us": default_us})  # fmt: skip
            cfg_s = " ".join(f"{a}={b}" for a, b in best.items())
            print(
                f"{model:<11}{name:<8}{m:>4}{floor:>9.1f}{cublas:>8.1f}{cublaslt:>8.1f}{best_us:>8.1f}"
                f"{default_us:>8.1f}  {cfg_s}",
                flush=True,
            )
    for model in SHAPES:
        for m in ROWS:
            sel = [r for r in rows if r["model"] == model and r["m"] == m]
            print(
                f"{model} M={m}: layer floor {sum(r['floor_us'] for r in sel):.1f} us, cuBLAS "
                f"{sum(r['cublas_us'] for r in sel):.1f}, Triton best "
                f"{sum(r['triton_best_us'] for r in sel):.1f}, default "
                f"{sum(r['triton_default_us'] for r in sel):.1f}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bytes_per_s": copy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
