"""A mixture-of-experts layer on CUDA in four launches, with no host synchronization (so it
runs inside CUDA graphs). The torch reference is model/moe.py's `FusedMoE.partial` on the CPU.

    route     router logits [T, E] -> each token's k experts and weights (softmax in float32,
              top-k, renormalized when asked); counts each real token's experts
    align     the T k (token, expert) pairs sorted by expert, each expert's run padded to a
              whole block of BLOCK_M rows; one expert per block
    gate/up   per block: x rows of its pairs @ the expert's gate and up rows, silu(g) * u
              -> h [T k, I]
    down      per block: h rows @ the expert's down rows, times the pair's routing weight
              -> y [T k, hidden]; then the sum over each token's k pairs, in slot order

    pairs (token, slot -> expert):  (0,0->5) (0,1->2) (1,0->5) (1,1->7)     BLOCK_M = 4
    sorted ids:  | 1  P  P  P | 0  2  P  P | 3  P  P  P |   (P = T k: padding, never stored)
    expert ids:  |    2       |    5       |    7       |

A block reads its expert's weights once, whatever the batch: a decode step of a few tokens
reads each routed expert's weights once per block of rows (once, while T k <= BLOCK_M), and
no expert that no token reaches. Sizes are fixed by T and k alone (at most T k + E' (BLOCK_M
- 1) slots, E' = min(E, T k)); programs past the step's real blocks return at once.

Tile sizes come from a rule on the rows per expert (`tile_config`), not from a table of
tuned shapes, so no shape falls back to an untuned default.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from octavo.kernels.pdl import pdl_args


@triton.jit
def _route_kernel(
    logits_ptr, ids_ptr, weights_ptr, counts_ptr, real_ptr, stride, num_experts,
    TOP_K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_E: tl.constexpr,
    RENORMALIZE: tl.constexpr, COUNT: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's writes are visible from here
    token = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < num_experts
    logits = tl.load(logits_ptr + token * stride + offs, mask=valid, other=-float("inf"))
    logits = logits.to(tl.float32)
    p = tl.exp(logits - tl.max(logits, 0))
    p = tl.where(valid, p, 0.0)
    p = p / tl.sum(p, 0)
    left = tl.where(valid, p, -1.0)
    slots = tl.arange(0, K_POW2)
    picked = tl.zeros([K_POW2], tl.float32)
    chosen = tl.zeros([K_POW2], tl.int32)
    for i in tl.static_range(TOP_K):  # the largest left; ties to the lowest expert
        best = tl.max(left, 0)
        expert = tl.min(tl.where(left == best, offs, BLOCK_E), 0)
        picked = tl.where(slots == i, best, picked)
        chosen = tl.where(slots == i, expert, chosen)
        left = tl.where(offs == expert, -1.0, left)
    if RENORMALIZE:
        picked = picked / tl.sum(picked, 0)
    keep = slots < TOP_K
    tl.store(ids_ptr + token * TOP_K + slots, chosen, mask=keep)
    tl.store(weights_ptr + token * TOP_K + slots, picked, mask=keep)
    if COUNT:  # the load histogram, for real tokens only (not a CUDA graph's padding rows)
        real = token < tl.load(real_ptr)
        tl.atomic_add(counts_ptr + chosen, tl.full([K_POW2], 1, tl.int64), mask=keep & real)


@triton.jit
def _align_kernel(
    ids_ptr, sorted_ptr, block_expert_ptr, total_ptr, num_pairs, first, num_local,
    BLOCK_M: tl.constexpr, BINS: tl.constexpr, PAIRS: tl.constexpr, MAX_BLOCKS: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """A program per local expert: every program counts all the pairs' experts (a histogram,
    whose last bin takes the pairs of experts outside first .. first + num_local - 1, another
    rank's), so each knows where its run starts; then it places its own pairs in pair order,
    pads its run and names its blocks."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    expert = tl.program_id(0)
    offs = tl.arange(0, PAIRS)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1) - first
    ours = (offs < num_pairs) & (ids >= 0) & (ids < num_local)
    counts = tl.histogram(tl.where(ours, ids, BINS - 1), BINS)
    bins = tl.arange(0, BINS)
    counts = tl.where(bins < num_local, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = tl.cumsum(padded, 0) - padded
    start = tl.sum(tl.where(bins == expert, starts, 0), 0)
    count = tl.sum(tl.where(bins == expert, counts, 0), 0)
    size = tl.sum(tl.where(bins == expert, padded, 0), 0)  # its run, padded
    if expert == 0:
        tl.store(total_ptr, tl.sum(padded, 0))
    hit = ours & (ids == expert)
    rank = tl.cumsum(hit.to(tl.int32), 0) - 1
    tl.store(sorted_ptr + start + rank, offs, mask=hit)
    pad = tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + start + count + pad, tl.full([BLOCK_M], 0, tl.int32) + num_pairs,
             mask=pad < size - count)  # fmt: skip
    blocks = tl.arange(0, MAX_BLOCKS)
    tl.store(block_expert_ptr + start // BLOCK_M + blocks, tl.full([MAX_BLOCKS], 0, tl.int32)
             + expert, mask=blocks < size // BLOCK_M)  # fmt: skip


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:  # float32 tests: no tf32 rounding
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ptr, block_expert_ptr, total_ptr, b_scale_ptr,
    N, K, num_pairs, up_offset,
    stride_am, stride_be, stride_bn, stride_cm, stride_se,
    ROWS_PER_A: tl.constexpr, GATED: tl.constexpr, WEIGHTED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, IEEE: tl.constexpr, SCALED: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """c[pair, n] = sum_k a[pair // ROWS_PER_A, k] b[expert, n, k] over the block's pairs;
    GATED: silu(that) * (the same over b's rows n + up_offset); WEIGHTED: times the pair's
    routing weight. b [E, rows, K] has unit stride along K; SCALED: b holds e4m3 codes,
    widened to a's dtype for the dot, and row r of expert e is times b_scale[e, r]."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    num_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    block, pid_n = pid // num_n, pid % num_n
    if block * BLOCK_M >= tl.load(total_ptr):
        return
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    pairs = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    real = pairs < num_pairs
    a_rows = tl.where(real, pairs // ROWS_PER_A, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (offs_k < K - k0) | EVEN_K
        a = tl.load(a_ptrs, mask=real[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(a.dtype)
        acc = _dot(a, b, acc, IEEE)
        if GATED:
            b_up = tl.load(b_ptrs + up_offset * stride_bn, mask=k_ok[:, None] & n_ok[None, :],
                           other=0.0).to(a.dtype)  # fmt: skip
            acc_up = _dot(a, b_up, acc_up, IEEE)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if SCALED:  # each output row's scale, after the sum over K
        scale_row = b_scale_ptr + expert * stride_se + offs_n
        acc = acc * tl.load(scale_row, mask=n_ok, other=0.0)[None, :]
        if GATED:
            acc_up = acc_up * tl.load(scale_row + up_offset, mask=n_ok, other=0.0)[None, :]
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if WEIGHTED:
        acc = acc * tl.load(weights_ptr + pairs, mask=real, other=0.0)[:, None]
    c_ptrs = c_ptr + tl.where(real, pairs, 0).to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=real[:, None] & n_ok[None, :])


@triton.jit
def _small_gate_up_kernel(
    x_ptr, w13_ptr, h_ptr, ids_ptr, scale_ptr, first, num_local, num_pairs, hidden, inter,
    stride_xm, stride_be, stride_bn, stride_se,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALED: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """A few rows, no sort: a program per (pair, tile of BLOCK_N features), h[pair] =
    silu(gate x) * up x on the FMA units. The pairs of a tile are neighbours in the grid,
    so pairs that share an expert read its tile together (from L2 after the first)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    pair, tile = pid % num_pairs, pid // num_pairs
    expert = tl.load(ids_ptr + pair) - first
    if (expert < 0) | (expert >= num_local):
        return
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + (pair // TOP_K).to(tl.int64) * stride_xm
    w = w13_ptr + expert.to(tl.int64) * stride_be + offs_n[:, None].to(tl.int64) * stride_bn
    gate = tl.zeros([BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = offs_k < hidden - k0
        x = tl.load(x_row + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        mask = n_ok[:, None] & k_ok[None, :]
        wg = tl.load(w + k0 + offs_k[None, :], mask=mask, other=0.0)
        wu = tl.load(w + inter * stride_bn + k0 + offs_k[None, :], mask=mask, other=0.0)
        gate += tl.sum(wg.to(tl.float32) * x[None, :], 1)
        up += tl.sum(wu.to(tl.float32) * x[None, :], 1)
    if SCALED:  # e4m3 codes: each row's scale
        scale_row = scale_ptr + expert.to(tl.int64) * stride_se + offs_n
        gate = gate * tl.load(scale_row, mask=n_ok, other=0.0)
        up = up * tl.load(scale_row + inter, mask=n_ok, other=0.0)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(h_ptr + pair.to(tl.int64) * inter + offs_n, out.to(h_ptr.dtype.element_ty),
             mask=n_ok)  # fmt: skip


@triton.jit
def _small_down_kernel(
    h_ptr, w2_ptr, out_ptr, ids_ptr, weights_ptr, scale_ptr, first, num_local, num_tokens,
    hidden, inter, stride_be, stride_bn, stride_om, stride_se,
    TOP_K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALED: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """A program per (token, tile of BLOCK_N outputs): weight * (h[pair] @ the expert's down
    rows) for the token's k pairs at once (a [k, BLOCK_N, BLOCK_K] load an iteration, so
    the k experts' reads are in flight together), then their sum in a fixed order, rounded
    once."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    token, tile = pid % num_tokens, pid // num_tokens
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    slots = tl.arange(0, K_POW2)
    pairs = token * TOP_K + slots
    experts = tl.load(ids_ptr + pairs, mask=slots < TOP_K, other=-1) - first
    ours = (slots < TOP_K) & (experts >= 0) & (experts < num_local)
    w = w2_ptr + tl.where(ours, experts, 0).to(tl.int64)[:, None, None] * stride_be
    w += offs_n.to(tl.int64)[None, :, None] * stride_bn
    h_rows = h_ptr + pairs.to(tl.int64)[:, None] * inter
    acc = tl.zeros([K_POW2, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = offs_k < inter - k0
        h_mask = ours[:, None] & k_ok[None, :]
        h = tl.load(h_rows + k0 + offs_k[None, :], mask=h_mask, other=0.0).to(tl.float32)
        w_mask = h_mask[:, None, :] & n_ok[None, :, None]
        wd = tl.load(w + k0 + offs_k[None, None, :], mask=w_mask, other=0.0)
        acc += tl.sum(wd.to(tl.float32) * h[:, None, :], 2)
    weights = tl.load(weights_ptr + pairs, mask=ours, other=0.0)
    if SCALED:  # e4m3 codes: each expert's row scales
        scales = scale_ptr + tl.where(ours, experts, 0).to(tl.int64)[:, None] * stride_se
        acc = acc * tl.load(scales + offs_n[None, :], mask=ours[:, None] & n_ok[None, :], other=0.0)
    out = tl.sum(acc * weights[:, None], 0)
    tl.store(out_ptr + token.to(tl.int64) * stride_om + offs_n,
             out.to(out_ptr.dtype.element_ty), mask=n_ok)  # fmt: skip


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def tile_config(num_pairs: int, num_experts: int, element_size: int = 2) -> TileConfig:
    """Tiles by the mean rows an expert gets: 16-row blocks while most experts see a few
    rows (decode: every block is weight reads), 32-row ones from 8 rows (so that one block,
    one read of the weights, holds nearly every expert's rows), larger ones as the rows per
    expert grow. float32 halves BLOCK_K to fit shared memory."""
    rows = num_pairs / num_experts
    if rows <= 8:
        cfg = TileConfig(16, 64, 128, 4, 4)
    elif rows <= 64:
        cfg = TileConfig(32, 64, 128, 4, 3)
    elif rows <= 256:
        cfg = TileConfig(64, 128, 64, 4, 4)
    else:
        cfg = TileConfig(128, 128, 64, 8, 3)
    return cfg if element_size <= 2 else replace(cfg, block_k=cfg.block_k // 2)


# Pairs up to which the align kernel runs (each program holds every pair); beyond, torch sorts.
ALIGN_KERNEL_MAX_PAIRS = 4096
# Pairs up to which the small path runs (no sort: two kernels on the FMA units).
SMALL_MAX_PAIRS = 32


def route(
    logits: torch.Tensor, top_k: int, renormalize: bool,
    counts: torch.Tensor | None = None, real_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """logits [T, E] -> (experts [T, k] int32, weights [T, k] float32). With `counts` [E]
    int64, adds each of the first `real_tokens` ([1] int32) tokens' experts to it."""
    num_tokens, num_experts = logits.shape
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    if num_tokens:
        count = counts is not None and real_tokens is not None
        _route_kernel[(num_tokens,)](
            logits, ids, weights, counts if count else ids, real_tokens if count else ids,
            logits.stride(0), num_experts, TOP_K=top_k, K_POW2=triton.next_power_of_2(top_k),
            BLOCK_E=triton.next_power_of_2(num_experts), RENORMALIZE=renormalize, COUNT=count,
            num_warps=1 if num_experts <= 256 else 4, **pdl_args(logits.device),
        )  # fmt: skip
    return ids, weights


def align(
    ids: torch.Tensor, num_local: int, block_m: int, first: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] (global expert ids) -> (sorted pair ids [S] int32, padded with T k; each
    block's local expert [S / block_m] int32; the slots in use [1] int32). Experts first ..
    first + num_local - 1 are this rank's; pairs of other experts are left out."""
    num_pairs = ids.numel()
    used = min(num_local, num_pairs)
    slots = triton.cdiv(num_pairs + used * (block_m - 1), block_m) * block_m
    device = ids.device
    sorted_ids = torch.empty(slots, dtype=torch.int32, device=device)
    block_expert = torch.empty(slots // block_m, dtype=torch.int32, device=device)
    total = torch.empty(1, dtype=torch.int32, device=device)
    if num_pairs <= ALIGN_KERNEL_MAX_PAIRS:
        pairs = triton.next_power_of_2(num_pairs)
        _align_kernel[(num_local,)](
            ids, sorted_ids, block_expert, total, num_pairs, first, num_local,
            BLOCK_M=block_m, BINS=triton.next_power_of_2(num_local + 1), PAIRS=pairs,
            MAX_BLOCKS=max(triton.cdiv(pairs, block_m), 2), num_warps=4 if pairs <= 1024 else 8,
            **pdl_args(device),
        )  # fmt: skip
        return sorted_ids, block_expert, total
    return _align_torch(ids.flatten() - first, num_local, block_m, sorted_ids, block_expert)


def _align_torch(local, num_local, block_m, sorted_ids, block_expert):
    """align's sort in torch ops of fixed sizes (for large T, where they are parallel)."""
    num_pairs = local.numel()
    ours = (local >= 0) & (local < num_local)
    key = torch.where(ours, local, num_local).long()
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=local.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_local]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    run_start = torch.cumsum(counts, 0) - counts
    sorted_key = key[order]
    # The key num_local (another rank's pairs) looks up a last entry past every slot.
    rank = torch.arange(num_pairs, device=local.device) - F.pad(run_start, (0, 1))[sorted_key]
    dest = F.pad(ends - padded, (0, 1), value=sorted_ids.numel())[sorted_key] + rank
    sorted_ids.fill_(num_pairs)
    keep = sorted_key < num_local
    dest = torch.where(keep, dest, sorted_ids.numel())  # other ranks' pairs: a dropped slot
    spill = torch.cat([sorted_ids, sorted_ids.new_empty(1)])
    spill.scatter_(0, dest.clamp(max=sorted_ids.numel()), order.to(torch.int32))
    sorted_ids.copy_(spill[:-1])
    starts = torch.arange(block_expert.numel(), device=local.device) * block_m
    block_expert.copy_(torch.searchsorted(ends, starts, right=True).to(torch.int32))
    return sorted_ids, block_expert, ends[-1:].to(torch.int32)


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
    weights: torch.Tensor, first: int = 0, num_experts: int | None = None,
    config: TileConfig | None = None, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [T, hidden], w13 [E', 2 I, hidden], w2 [E', hidden, I] (this rank's experts first ..
    first + E' - 1 of num_experts), ids / weights [T, k] -> [T, hidden]: the sum over each
    token's k pairs of weight * down(silu(gate x) * up x), pairs of experts this rank lacks
    counting 0. With `scales` (float32 [E', 2 I] and [E', hidden]) w13 and w2 hold e4m3
    codes, a weight being its code times its row's scale (activations stay in x's dtype)."""
    num_tokens, hidden = x.shape
    num_local, two_inter, _ = w13.shape
    inter, top_k = two_inter // 2, ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_tokens == 0:
        return torch.zeros_like(x)
    s13, s2 = scales if scales is not None else (x, x)  # any tensor: unread without scales
    scaled = {"SCALED": scales is not None}
    if num_pairs <= SMALL_MAX_PAIRS and config is None:
        return _small(x, w13, w2, ids, weights, first, s13, s2, scaled)
    cfg = config or tile_config(num_pairs, num_local, x.element_size())
    sorted_ids, block_expert, total = align(ids, num_local, cfg.block_m, first)
    num_blocks = block_expert.numel()
    ieee = x.dtype == torch.float32
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    common = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, IEEE=ieee,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x.device))  # fmt: skip
    _moe_gemm_kernel[(num_blocks * triton.cdiv(inter, cfg.block_n),)](
        x, w13, h, weights, sorted_ids, block_expert, total, s13, inter, hidden, num_pairs,
        inter, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0), s13.stride(0),
        ROWS_PER_A=top_k, GATED=True, WEIGHTED=False, EVEN_K=hidden % cfg.block_k == 0,
        **common, **scaled,
    )  # fmt: skip
    # Pairs of another rank's experts are never written: they must read as 0.
    alloc = torch.zeros if num_local < (num_experts or num_local) else torch.empty
    y = alloc(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _moe_gemm_kernel[(num_blocks * triton.cdiv(hidden, cfg.block_n),)](
        h, w2, y, weights, sorted_ids, block_expert, total, s2, hidden, inter, num_pairs, 0,
        h.stride(0), w2.stride(0), w2.stride(1), y.stride(0), s2.stride(0),
        ROWS_PER_A=1, GATED=False, WEIGHTED=True, EVEN_K=inter % cfg.block_k == 0, **common,
        **scaled,
    )  # fmt: skip
    return y.view(num_tokens, top_k, hidden).sum(1)


def _small(x, w13, w2, ids, weights, first, s13, s2, scaled):
    """fused_experts for a few rows: a kernel per projection, no sort (see the kernels)."""
    num_tokens, hidden = x.shape
    num_local, inter, top_k = w13.shape[0], w13.shape[1] // 2, ids.shape[1]
    num_pairs = num_tokens * top_k
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    pdl = pdl_args(x.device)
    block_n, block_k = SMALL_GATE_UP_TILES
    _small_gate_up_kernel[(num_pairs * triton.cdiv(inter, block_n),)](
        x, w13, h, ids, s13, first, num_local, num_pairs, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0),
        TOP_K=top_k, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, **pdl, **scaled,
    )  # fmt: skip
    out = torch.empty_like(x)
    block_n, block_k = SMALL_DOWN_TILES
    _small_down_kernel[(num_tokens * triton.cdiv(hidden, block_n),)](
        h, w2, out, ids, weights, s2, first, num_local, num_tokens, hidden, inter,
        w2.stride(0), w2.stride(1), out.stride(0), s2.stride(0), TOP_K=top_k,
        K_POW2=triton.next_power_of_2(top_k), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=8,
        **pdl, **scaled,
    )  # fmt: skip
    return out


# The small path's (BLOCK_N, BLOCK_K): gate/up's program reads two [BLOCK_N, BLOCK_K] tiles
# an iteration, down's k of them (measured on an H100 at Qwen3-30B-A3B's shapes).
SMALL_GATE_UP_TILES = (16, 512)
SMALL_DOWN_TILES = (4, 256)
