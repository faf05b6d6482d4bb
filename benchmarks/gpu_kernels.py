"""The Triton attention kernels at Qwen3-0.6B shapes on the GPU, against their floors: decode
and store_kv against the copy ceiling measured in the same run (bytes moved / time), prefill
in TFLOP/s beside torch's own kernels on the same problem; the weight-only quantized GEMMs
at Qwen3-8B's projection shapes against bf16 F.linear.

    python benchmarks/gpu_kernels.py [--sweep] [--only decode|prefill|store|quant] [--json f]
    python benchmarks/gpu_kernels.py --sass     # no GPU needed: the GEMVs' loops on sm_90

Rows (H=16, KVH=8, D=128, bf16, pages of 16):
  decode  256 x 1k context, 256 / 128 / 64 x mixed contexts (100-2048), 1 x 8k, 16 x 4k
          -> KV bytes read / time against the copy ceiling; then over an fp8 cache
  prefill 8 x 1k new tokens (no prefix), 1 x 1k new behind a 7k prefix, a 16k-token step
          drawn like the nano-vllm workload's (at 16 and at 32 query heads) -> TFLOP/s, with
          torch SDPA's flash kernel on the same dense problem as a yardstick, and torch's
          FlashAttention-2 varlen forward and cuDNN's ragged attention where they apply
  store_kv 8k tokens -> bytes written / time against the copy ceiling
  quant   int4 (group 128), int8 and fp8 at 1, 16, 64 and 256 rows (fp8: the GEMV at one
          row, then torch._scaled_mm), Qwen3-8B's qkv 4096->6144,
          o 4096->4096, gate_up 4096->24576, down 12288->4096 -> weight bytes read / time,
          and the time as a fraction of bf16 F.linear's at the same shape; then the four
          summed at one row, as a decode step's projections

--sass compiles the one-row GEMV (int4, int8, fp8) for sm_90 with Triton's own ptxas and
counts the SASS instructions in its K loop: per code, and as the issue time of Qwen3-8B's
four projections (4 warp instructions a clock per SM, 132 SMs at 1.98 GHz, an H100 SXM).

Times are do_bench medians (the L2 is flushed before each repetition, so an 8k decode reads
its 33 MB from HBM). Each kernel is checked against the torch backend first. --sweep also
times the tile configs and split counts listed below and marks the fastest. The quantized
GEMMs and their bf16 baseline are timed as CUDA graphs over enough copies of the weight to
overflow L2 (runner/gemm_tuning.py's graph_us), as a decode step runs them.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import subprocess
import tempfile
from functools import partial

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from octavo.attention.backend import build_metadata
from octavo.attention.torch_backend import TorchAttentionBackend, write_kv_cache
from octavo.kernels import quant_fp8, quant_gemm
from octavo.kernels.decode_attention import (
    choose_num_splits,
    decode_attention,
    default_decode_config,
    num_sms,
)
from octavo.kernels.prefill_attention import default_prefill_config, prefill_attention
from octavo.kernels.store_kv import store_kv
from octavo.quant import rounding
from octavo.runner.gemm_tuning import graph_us

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 16, 8, 128, 16, torch.bfloat16
SCALE = HEAD_DIM**-0.5
# (batch, context); "mixed": the nano-vllm workload's decode, contexts uniform in 100..2048.
DECODE_CASES = [(256, 1024), (256, "mixed"), (128, "mixed"), (64, "mixed"), (1, 8192), (16, 4096)]


def _workload_step(tokens: int = 16384) -> list[int]:
    """Prompt lengths of a prefill step like the nano-vllm workload's: randint(100, 1024) each
    (BENCHMARKS.md; its own draw, not the workload's prompts), the last one cut so that the
    step holds `tokens`, as the scheduler cuts."""
    rng = random.Random(0)
    lens: list[int] = []
    while sum(lens) < tokens:
        lens.append(min(rng.randint(100, 1024), tokens - sum(lens)))
    return lens


_STEP = _workload_step()
# (query_lens, seq_lens, query heads): Qwen3-0.6B's 16 heads; Qwen3-8B's 32 (GQA 4).
PREFILL_CASES = [
    ([1024] * 8, [1024] * 8, HEADS),
    ([1024], [8192], HEADS),
    (_STEP, _STEP, HEADS),
    (_STEP, _STEP, 32),
]
DECODE_CONFIGS = [
    {"block_n": n, "num_warps": w, "num_stages": s}
    for n in (32, 64, 128)
    for w in (4, 8)
    for s in (2, 3, 4)
]
DECODE_SPLITS = [1, 2, 4, 8, 16, 32, 64]
# Qwen3-8B's projections (name, N, K) and the row counts the quant stage times.
QUANT_SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096),
                ("down", 4096, 12288)]  # fmt: skip
QUANT_ROWS = [1, 16, 64, 256]
PREFILL_CONFIGS = [
    {"block_m": m, "block_n": n, "num_warps": w, "num_stages": s}
    for m, n, w, s in [
        (128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3),
        (128, 32, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 3), (64, 32, 4, 4),
        (64, 128, 4, 2), (64, 128, 4, 3), (128, 64, 4, 3), (128, 128, 4, 2), (32, 64, 4, 3),
    ]
]  # fmt: skip


def median_us(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def measure(run, ref: torch.Tensor) -> tuple[float, float]:
    """(median us, rel err vs ref); NaNs for a tile config the chip cannot hold."""
    try:
        err = rel_err(run(), ref)
    except triton.runtime.errors.OutOfResources as e:
        print(f"skipped a config: {e}")
        return float("nan"), float("nan")
    return median_us(run), err


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB, counting bytes read plus bytes written, in GB/s."""
    src = torch.randn(512 * 2**20, device="cuda", dtype=DTYPE)
    dst = torch.empty_like(src)
    us = median_us(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / us / 1e3


def make_batch(query_lens: list[int], seq_lens: list[int], heads: int = HEADS):
    """Random q/k/v, a random cache, shuffled pages; the new K/V already stored."""
    pages = [triton.cdiv(s, BLOCK_SIZE) for s in seq_lens]
    perm = torch.randperm(sum(pages)).tolist()
    tables, used = [], 0
    for n in pages:
        tables.append(perm[used : used + n])
        used += n
    md = build_metadata(query_lens, seq_lens, tables, BLOCK_SIZE, "cuda")
    t = md.num_tokens
    q = torch.randn(t, heads, HEAD_DIM, device="cuda", dtype=DTYPE)
    k = torch.randn(t, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v = torch.randn(t, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    cache = torch.randn(2, sum(pages), BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    write_kv_cache(k, v, cache, md.slot_mapping)
    return q, k, v, cache, md


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def bench_decode(batch: int, context: int | str, copy_gbs: float, sweep: bool) -> list[dict]:
    if context == "mixed":
        rng = torch.Generator().manual_seed(batch)
        seq_lens = torch.randint(100, 2049, (batch,), generator=rng).tolist()
    else:
        seq_lens = [context] * batch
    q, k, v, cache, md = make_batch([1] * batch, seq_lens)
    ref = TorchAttentionBackend().forward(q, k, v, cache, md, SCALE)
    kv_bytes = 2 * sum(seq_lens) * KV_HEADS * HEAD_DIM * cache.element_size()
    splits0 = choose_num_splits(
        batch, KV_HEADS, md.block_tables.shape[1] * BLOCK_SIZE, num_sms(q.device)
    )
    cfg0 = default_decode_config(HEAD_DIM)
    # The engine passes the longest-first order; one row without it shows what it buys.
    order = torch.argsort(md.seq_lens, descending=True).to(torch.int32)
    variants = [(splits0, cfg0, True), (splits0, cfg0, False)]
    if sweep:
        variants += [(s, cfg0, True) for s in DECODE_SPLITS if s != splits0]
        variants += [(splits0, c, True) for c in DECODE_CONFIGS if c != cfg0]
    rows = []
    for splits, cfg, ordered in variants:
        run = partial(
            decode_attention,
            q,
            cache,
            md.seq_lens,
            md.block_tables,
            SCALE,
            splits,
            config=cfg,
            order=order if ordered else None,
        )
        us, err = measure(run, ref)
        label = _cfg_str(cfg, splits) + ("" if ordered else " unordered")
        rows.append(
            _row("decode", f"{batch} x {context}", label,
                 (splits, cfg, ordered) == (splits0, cfg0, True), us, err,
                 _bandwidth(kv_bytes, us, copy_gbs))
        )  # fmt: skip
    # The same over an e4m3 cache (k / 0.5, v / 2), against the torch backend on its values.
    scales = {"k_scale": 0.5, "v_scale": 2.0}
    fp8 = torch.stack([(cache[0] / 0.5), (cache[1] / 2.0)]).to(torch.float8_e4m3fn)
    widened = torch.stack([fp8[0].to(DTYPE) * 0.5, fp8[1].to(DTYPE) * 2.0])
    ref8 = decode_attention(q, widened, md.seq_lens, md.block_tables, SCALE, splits0, config=cfg0)
    run = partial(decode_attention, q, fp8, md.seq_lens, md.block_tables, SCALE, splits0,
                  config=cfg0, order=order, **scales)  # fmt: skip
    us, err = measure(run, ref8)
    rows.append(_row("decode fp8", f"{batch} x {context}", _cfg_str(cfg0, splits0), True, us,
                     err, _bandwidth(kv_bytes // 2, us, copy_gbs)))  # fmt: skip
    return rows


def bench_prefill(
    query_lens: list[int], seq_lens: list[int], heads: int, sweep: bool
) -> list[dict]:
    q, k, v, cache, md = make_batch(query_lens, seq_lens, heads)
    ref = TorchAttentionBackend().forward(q, k, v, cache, md, SCALE)
    flops = sum(4 * heads * HEAD_DIM * (ql * (s - ql) + ql * (ql + 1) / 2)
                for ql, s in zip(query_lens, seq_lens, strict=True))  # fmt: skip
    cfg0 = default_prefill_config(HEAD_DIM, heads // KV_HEADS)
    variants = [cfg0] + ([c for c in PREFILL_CONFIGS if c != cfg0] if sweep else [])
    if len(set(query_lens)) == 1:
        shape = f"{len(query_lens)} x {query_lens[0]} new / {seq_lens[0]} ctx"
    else:
        shape = f"{sum(query_lens)}-token step ({len(query_lens)} prompts)"
    shape += f", {heads} heads" if heads != HEADS else ""
    rows = []
    for cfg in variants:
        run = partial(
            prefill_attention, q, cache, md.query_start_loc, md.seq_lens, md.block_tables, SCALE,
            md.num_seqs, config=cfg,
        )  # fmt: skip
        us, err = measure(run, ref)
        rows.append(
            _row(
                "prefill",
                shape,
                _cfg_str(cfg),
                cfg == cfg0,
                us,
                err,
                f"{flops / us / 1e6:7.1f} TFLOP/s",
            )
        )
    no_prefix = all(ql == s for ql, s in zip(query_lens, seq_lens, strict=True))
    max_q, max_k = max(query_lens), max(seq_lens)
    rows += bench_torch_flash(q, k, v, cache, md, no_prefix, max_q, max_k, shape, flops, ref)
    if no_prefix:
        rows += bench_torch_cudnn(q, k, v, md, max_q, shape, flops, ref)
    if no_prefix and len(set(seq_lens)) == 1:
        dense = [t.view(len(seq_lens), -1, n, HEAD_DIM).transpose(1, 2) for t, n in
                 ((q, HEADS), (k.repeat_interleave(2, 1), HEADS), (v.repeat_interleave(2, 1), HEADS))]  # fmt: skip
        us = median_us(partial(F.scaled_dot_product_attention, *dense, is_causal=True, scale=SCALE))
        rate = f"{flops / us / 1e6:7.1f} TFLOP/s"
        rows.append(_row("torch sdpa", shape, "dense, no paging", False, us, float("nan"), rate))
    return rows


def bench_torch_flash(q, k, v, cache, md, no_prefix, max_q, max_k, shape, flops, ref) -> list[dict]:
    """torch's own FlashAttention-2 forward (`aten._flash_attention_forward`, what
    `torch.nn.attention.varlen.varlen_attn` calls) on the same problem: over the new K/V as
    contiguous [T, KVH, D] tensors where no sequence has a cached prefix, and over the paged
    cache through its block table otherwise (torch 2.11's op has no block-table argument)."""
    nan = float("nan")
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if op is None:
        return [_row("torch fa2", shape, "missing in this torch", False, nan, nan, "")]
    cu_q = md.query_start_loc
    if no_prefix:
        kv, config = (k, v, cu_q, cu_q), "contiguous new K/V"
        extra = {}
    else:
        kv, config = (cache[0], cache[1], cu_q, None), "paged, block table"
        extra = {"seqused_k": md.seq_lens, "block_table": md.block_tables}

    def run():
        return op(q, *kv, max_q, max_k, 0.0, True, False, scale=SCALE, **extra)[0]

    try:
        us, err = measure(run, ref)
    except RuntimeError as e:
        reason = str(e).splitlines()[0][:80]
        return [_row("torch fa2", shape, f"{config}: refused", False, nan, nan, reason)]
    return [_row("torch fa2", shape, config, False, us, err, f"{flops / us / 1e6:7.1f} TFLOP/s")]


def bench_torch_cudnn(q, k, v, md, max_q, shape, flops, ref) -> list[dict]:
    """cuDNN's fused attention (`aten._cudnn_attention_forward`) on ragged sequences of new
    tokens, K/V repeated up to the query heads inside the timed call (it takes no GQA)."""
    nan = float("nan")
    op = getattr(torch.ops.aten, "_cudnn_attention_forward", None)
    if op is None:
        return []
    group = q.shape[1] // k.shape[1]
    cu = md.query_start_loc

    def run():
        ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return op(q, ke, ve, None, cu, cu, max_q, max_q, False, 0.0, True, False, scale=SCALE)[0]

    try:
        us, err = measure(run, ref)
    except RuntimeError as e:
        reason = str(e).splitlines()[0][:80]
        return [_row("cudnn", shape, "ragged: refused", False, nan, nan, reason)]
    rate = f"{flops / us / 1e6:7.1f} TFLOP/s"
    return [_row("cudnn", shape, "ragged, K/V repeated", False, us, err, rate)]


def bench_store(num_tokens: int, copy_gbs: float) -> dict:
    _, k, v, cache, md = make_batch([num_tokens], [num_tokens])
    slots = md.slot_mapping
    us = median_us(lambda: store_kv(k, v, cache, slots))
    moved = 2 * 2 * k.numel() * k.element_size()  # k and v, read and written
    return _row(
        "store_kv", f"{num_tokens} tokens", "", True, us, 0.0, _bandwidth(moved, us, copy_gbs)
    )


def _copies(tensors: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, ...]]:
    """Enough copies of a weight's tensors to hold 1.5 times the L2, two at least."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    size = sum(t.numel() * t.element_size() for t in tensors)
    extra = max(1, 3 * l2 // (2 * size))
    return [tensors] + [tuple(t.clone() for t in tensors) for _ in range(extra)]


def _quant_variants(method: str, m: int, n: int, k: int, sweep: bool) -> list:
    """None for bf16; else the default plan first, then (--sweep) other kernels, tiles and
    split counts."""
    if method == "bf16" or (method == "fp8" and m > 1):
        return [None]
    bits, group = (4, 128) if method == "int4" else (8, quant_gemm.INT8_BLOCK)
    default = quant_gemm.plan(m, n, k, bits, group, num_sms(torch.device("cuda")))
    out = [default]
    if method == "fp8":  # the GEMV's tiles, then the scaled matmul it replaces at one row
        if sweep:
            out += [default._replace(block_n=bn, block_k=max(65536 // (bn * bits), group),
                                     splits=s)
                    for bn in (32, 64, 128) for s in (1, 2, 4, 8, 16)]  # fmt: skip
        return list(dict.fromkeys(out)) + [None]
    if not sweep:
        return out
    if m == 1:  # tiles of 32 to 128 rows, each thread with 4 rows by 4 words
        out += [default._replace(block_n=bn, block_k=max(65536 // (bn * bits), group), splits=s)
                for bn in (32, 64, 128) for s in (1, 2, 4, 8, 16)]  # fmt: skip
        out += [default._replace(num_stages=st) for st in (2, 4)]
    block_m = min(max(16, triton.next_power_of_2(m)), 128)
    out += [quant_gemm.Plan("gemm", block_m, bn, 128, s, w, st)
            for bn, w in ((64, 4), (128, 4), (128, 8)) for s in (1, 2, 4, 8, 16)
            for st in (3, 4) if s == 1 or block_m <= 64]  # fmt: skip
    if m > 128:
        out.append(quant_gemm.Plan("gemm", 256, 128, 128, 1, 8, 2))
    out.append(quant_gemm.Plan("dequant", m, 32, max(512 // bits, group), 1, 4, 1))
    return list(dict.fromkeys(out))


def _quant_product(method: str, x: torch.Tensor, p, tensors: tuple) -> torch.Tensor:
    if method == "bf16":
        return F.linear(x, tensors[0])
    if method == "int4":
        return quant_gemm.int4_linear(x, *tensors, 128, config=p)
    if method == "fp8" and p is not None:
        return quant_gemm.fp8_gemv(x, *tensors, config=p)
    if method == "fp8":  # W8A8: x quantized per token, then cuBLASLt's scaled matmul
        xq, x_scale = quant_fp8.per_token_quant_fp8(x)
        w, w_scale = tensors
        return torch._scaled_mm(
            xq, w.t(), scale_a=x_scale[:, None], scale_b=w_scale[None, :], out_dtype=x.dtype
        )
    return quant_gemm.int8_linear(x, *tensors, config=p)


def bench_quant(copy_gbs: float, sweep: bool) -> list[dict]:
    rows, at_one_row = [], {}
    for name, n, k in QUANT_SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=DTYPE) * 0.02
        codes, scale, lo = rounding.quantize_int4(w, 128, DTYPE)
        codes8, scale8 = rounding.quantize_int8(w, DTYPE)
        codes_fp8, scale_fp8 = rounding.quantize_fp8(w)
        weights = {  # method: (copies of its tensors, the float32 weight they hold)
            "bf16": (_copies((w,)), w.float()),
            "int4": (
                _copies((quant_gemm.pack_int4(codes, 128), scale, lo)),
                rounding.dequantize_int4(codes, scale, lo, k, torch.float32),
            ),
            "int8": (
                _copies((quant_gemm.pack_int8(codes8), scale8)),
                rounding.dequantize_int8(codes8, scale8, torch.float32),
            ),
            "fp8": (
                _copies((codes_fp8, scale_fp8)),
                rounding.dequantize_fp8(codes_fp8, scale_fp8, torch.float32),
            ),
        }
        for m in QUANT_ROWS:
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            shape, bf16_us = f"{name} {n}x{k} at {m}", None
            for method, (copies, w_ref) in weights.items():
                ref = x.float() @ w_ref.T
                moved = sum(t.numel() * t.element_size() for t in copies[0])
                for i, p in enumerate(_quant_variants(method, m, n, k, sweep)):
                    call = partial(_quant_product, method, x, p)
                    try:
                        err = rel_err(call(copies[0]), ref)
                        us = graph_us([partial(call, t) for t in copies], replays=20, rounds=3)
                    except triton.runtime.errors.OutOfResources as e:
                        print(f"skipped a config: {e}")
                        continue
                    rate = _bandwidth(moved, us, copy_gbs)
                    if method == "bf16":
                        bf16_us = us
                    else:
                        rate += f"  {us / bf16_us:5.2f} x bf16's time"
                    label = _plan_str(p) if p else ("_scaled_mm" if method == "fp8" else "F.linear")
                    rows.append(_row(method, shape, label, i == 0, us, err, rate))
                    if m == 1 and i == 0:
                        at_one_row[method] = at_one_row.get(method, 0.0) + us
    for method, us in at_one_row.items():
        rate = f"{us / at_one_row['bf16']:5.2f} x bf16's time"
        rows.append(_row(method, "4 projections at 1", "default", True, us, float("nan"), rate))
    return rows


def gemv_sass() -> None:
    """The one-row GEMV's loop, compiled for sm_90 without a GPU: instructions per code."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    codes = sum(n * k for _, n, k in QUANT_SHAPES)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    print(f"method  loop instructions  codes a thread  a code  issue of a layer's "
          f"{codes / 1e6:.0f}M codes  most frequent")  # fmt: skip
    for method, bits, block in (("int4", 4, 128), ("int8", 8, 64), ("fp8", 8, 64)):
        p = quant_gemm.plan(1, 4096, 4096, bits, block, 132)
        const = {"BITS": bits, "BLOCK": block, "BLOCK_N": p.block_n,
                 "TILE_G": p.block_k // block, "EVEN": True, "SPLIT": True,
                 "FP8": method == "fp8", "FP8_BLOCK": 0, "NUM_STAGES": p.num_stages,
                 "USE_PDL": False}  # fmt: skip
        scale = "*fp32" if method == "fp8" else "*bf16"
        sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "scale_ptr": scale, "min_ptr": "*bf16",
               "y_ptr": "*bf16", "partial_ptr": "*fp32", "counter_ptr": "*i32"}  # fmt: skip
        sig |= dict.fromkeys(["N", "K", "KW", "NG", "num_iters", "iters_per_split", "one"], "i32")
        sig |= dict.fromkeys(const, "constexpr")
        constants = {(list(sig).index(k),): v for k, v in const.items()}
        options = {"num_warps": p.num_warps, "num_stages": p.num_stages}
        src = ASTSource(quant_gemm._gemv_kernel, sig, constants)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            run = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, check=True)
        found = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)",
                           run.stdout.decode())  # fmt: skip
        sass = [(int(a, 16), op.split(".")[0], rest) for a, op, rest in found]
        loops = [(int(t, 16), a) for a, op, rest in sass if op == "BRA"
                 for t in re.findall(r"0x([0-9a-f]+)", rest) if int(t, 16) < a]  # fmt: skip
        start, end = max(loops, key=lambda span: span[1] - span[0])  # the K loop, the longest
        ops = collections.Counter(op for a, op, _ in sass if start <= a <= end)
        per_thread = p.block_n * p.block_k // (32 * p.num_warps)  # codes an iteration
        per_code = sum(ops.values()) / per_thread
        issue_us = codes * per_code / (32 * 4 * 132 * 1.98e3)
        common = ", ".join(f"{k} {v}" for k, v in ops.most_common(5))
        print(f"{method:7} {sum(ops.values()):17} {per_thread:15} {per_code:7.2f} "
              f"{issue_us:21.1f} us  {common}")  # fmt: skip


def _plan_str(p: quant_gemm.Plan) -> str:
    return (f"{p.kernel} m={p.block_m} n={p.block_n} k={p.block_k} splits={p.splits} "
            f"w={p.num_warps} s={p.num_stages}")  # fmt: skip


def _row(kernel: str, shape: str, config: str, default: bool, us: float, err: float, rate: str):
    return {"kernel": kernel, "shape": shape, "config": config, "default": default, "us": us,
            "rel_err": err, "rate": rate}  # fmt: skip


def _bandwidth(num_bytes: float, us: float, copy_gbs: float) -> str:
    gbs = num_bytes / us / 1e3
    return f"{gbs:7.0f} GB/s {100 * gbs / copy_gbs:4.0f}% of copy"


def _cfg_str(cfg: dict[str, int], splits: int | None = None) -> str:
    parts = [f"{k.replace('block_', '').replace('num_', '')}={v}" for k, v in cfg.items()]
    return ("" if splits is None else f"splits={splits} ") + " ".join(parts)


def print_table(rows: list[dict], copy_gbs: float) -> None:
    print(f"\n{torch.cuda.get_device_name()}  copy ceiling {copy_gbs:.0f} GB/s (read + write)")
    print(f"{'kernel':10} {'shape':26} {'config':48} {'us':>9} {'rel err':>8}  rate")
    for group in dict.fromkeys((r["kernel"], r["shape"]) for r in rows):
        mine = [r for r in rows if (r["kernel"], r["shape"]) == group]
        best = min((r["us"] for r in mine if r["us"] == r["us"]), default=None)
        for r in mine:
            tag = ("*" if r["default"] else " ") + (
                "<" if r["us"] == best and len(mine) > 1 else " "
            )
            print(f"{r['kernel']:10} {r['shape']:26} {r['config']:48} {r['us']:9.1f} "
                  f"{r['rel_err']:8.1e} {tag} {r['rate']}")  # fmt: skip
    print("* = default config   < = fastest of its group")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time other configs")
    parser.add_argument("--json", help="write all rows here")
    parser.add_argument("--only", choices=["decode", "prefill", "store", "quant"], help="one stage")
    parser.add_argument("--sass", action="store_true", help="the GEMVs' loops on sm_90 (no GPU)")
    args = parser.parse_args()
    if args.sass:
        return gemv_sass()
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth()
    rows = []
    if args.only in (None, "decode"):
        for batch, context in DECODE_CASES:
            rows += bench_decode(batch, context, copy_gbs, args.sweep)
    if args.only in (None, "prefill"):
        for query_lens, seq_lens, heads in PREFILL_CASES:
            rows += bench_prefill(query_lens, seq_lens, heads, args.sweep)
    if args.only in (None, "store"):
        rows.append(bench_store(8192, copy_gbs))
    if args.only in (None, "quant"):
        rows += bench_quant(copy_gbs, args.sweep)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbs": copy_gbs, "rows": rows}, f, indent=1)
    print_table(rows, copy_gbs)


if __name__ == "__main__":
    main()
