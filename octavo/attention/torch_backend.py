"""Attention over the paged KV cache in plain torch: the CPU path and the kernels' oracle."""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from octavo.attention.backend import AttentionBackend, AttentionMetadata, AttentionSpec
from octavo.kernels import cpu as cpu_kernels

DECODE_GROUPS = 4  # length groups of a decode step (see TorchAttentionBackend._decode)
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def to_kv_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x as a cache of `cache_dtype` holds it: for an fp8 (e4m3) cache, x / scale clamped to
    +-448 and rounded to e4m3; for any other cache x itself, its scale unused (1.0)."""
    if cache_dtype != FP8:
        return x.to(cache_dtype)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def from_kv_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """The inverse of `to_kv_cache`: e4m3 values times their scale, in `dtype`."""
    return x.to(dtype) * scale if x.dtype == FP8 else x.to(dtype)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as its bytes, for the copies that have no float8 kernel on the CPU."""
    return x.view(torch.uint8) if x.dtype == FP8 else x


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatters the new tokens' keys/values into their slots (`to_kv_cache`).

    k, v: [T, KVH, D]; kv_cache: [2, num_blocks, block_size, KVH, D]; slot_mapping: [T].
    """
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    flat = _bytes(kv_cache).view(2, -1, num_kv_heads, head_dim)  # [2, num_slots, KVH, D]
    flat[0].index_copy_(0, slot_mapping, _bytes(to_kv_cache(k, kv_cache.dtype, k_scale)))
    flat[1].index_copy_(0, slot_mapping, _bytes(to_kv_cache(v, kv_cache.dtype, v_scale)))


def gather_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first seq_len keys and values of one sequence, each [seq_len, KVH, D]."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = kv_cache[:, block_table[:num_blocks].long()]  # [2, nb, bs, KVH, D]
    blocks = blocks.flatten(1, 2)[:, :seq_len]  # [2, seq_len, KVH, D]
    return blocks[0], blocks[1]


def split_qkv(
    qkv: torch.Tensor, spec: AttentionSpec, rotation: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v heads of a qkv projection, q and k normalized (if the layer has norms) and
    rotated: what the Triton backend's fused kernels do before attention, through the spec's
    own modules (which pick their kernel by device).

    qkv: [T, (H + 2 * KVH) * D]; rotation: the rotary embedding's `cos_sin(positions,
    qkv.dtype)` for the tokens' positions -> q [T, H, D], k and v [T, KVH, D].
    """
    num_tokens, rope = qkv.shape[0], spec.rotary_emb
    cos, sin = rotation
    q_size, kv_size, _ = spec.qkv_sizes
    if spec.q_norm is None or spec.k_norm is None:  # q and k side by side: rotated at once
        qk = rope.rotate(qkv[:, : q_size + kv_size], cos, sin)
        q, k = qk[:, :q_size], qk[:, q_size:]
    else:
        q, k = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size]
        q = spec.q_norm(q.view(num_tokens, -1, spec.head_dim)).view(num_tokens, -1)
        k = spec.k_norm(k.view(num_tokens, -1, spec.head_dim)).view(num_tokens, -1)
        q, k = rope.rotate(q, cos, sin), rope.rotate(k, cos, sin)
    v = qkv[:, q_size + kv_size :]
    return (
        q.view(num_tokens, spec.num_heads, spec.head_dim),
        k.view(num_tokens, spec.num_kv_heads, spec.head_dim),
        v.contiguous().view(num_tokens, spec.num_kv_heads, spec.head_dim),
    )


@dataclass(frozen=True)
class _DecodeGroup:
    """Rows lo:hi of the length-sorted batch, padded to num_blocks blocks of context."""

    lo: int
    hi: int
    num_blocks: int
    # Rows of the cache viewed as [2 * cache_blocks, block_size * KVH * D]: the keys' blocks
    # of each sequence in turn, then the values' (value rows are offset by cache_blocks).
    cache_rows: torch.Tensor  # [2 * (hi - lo) * num_blocks] int64
    mask: torch.Tensor  # [hi - lo, 1, 1, num_blocks * block_size]: 0 in context, -inf past it
    seq_lens: torch.Tensor  # [hi - lo] the rows' context lengths
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)

    def window_mask(self, window: int) -> torch.Tensor:
        """`mask` with -inf also before each row's last `window` positions (made once a step
        for each window its layers use)."""
        found = self.windowed.get(window)
        if found is None:
            positions = torch.arange(self.mask.shape[-1], device=self.mask.device)
            before = positions[None, :] < (self.seq_lens - window)[:, None]  # [n, L]
            found = self.mask.masked_fill(before[:, None, None, :], float("-inf"))
            self.windowed[window] = found
        return found


@dataclass(frozen=True)
class _DecodePlan:
    """What every layer of one decode step shares: built once per step from its metadata."""

    order: torch.Tensor  # [B] sequences sorted by length
    inverse: torch.Tensor  # [B] position of each sequence in `order`
    in_order: bool  # the batch is sorted already (order and inverse are the identity)
    groups: list[_DecodeGroup]
    workspace_rows: int  # the most cache rows one group gathers


class TorchAttentionBackend(AttentionBackend):
    """Reference attention: one batched call per length group for pure-decode steps, a loop
    over sequences otherwise (prefill, chunked prefill and prefix hits all take the loop).

    NOTE: decode keeps two things between calls. The plan (gather indices and masks) is
    keyed on the metadata object, which all layers of a step share, so it is built once per
    step. The workspace the K/V are gathered into is reused by every layer and step: a fresh
    tensor per layer costs more than the copy into it."""

    name = "torch"

    def __init__(self) -> None:
        self._plans: list[tuple[tuple, _DecodePlan]] = []  # the newest first
        self._workspace: torch.Tensor | None = None
        self._rotation_key: tuple | None = None
        self._rotation: tuple[torch.Tensor, torch.Tensor] | None = None
        self._context_key: tuple[list[int], list[int]] | None = None
        self._context: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward_qkv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        spec: AttentionSpec,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """See AttentionBackend.forward_qkv: `split_qkv`, then `forward`."""
        q, k, v = split_qkv(qkv, spec, self._cos_sin(positions, qkv.dtype, md, spec))
        return self.forward(
            q, k, v, kv_cache, md, spec.scale, k_scale, v_scale, spec.sliding_window,
            spec.logit_softcap,
        )  # fmt: skip

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """See AttentionBackend.forward."""
        write_kv_cache(k, v, kv_cache, md.slot_mapping[: md.num_tokens], k_scale, v_scale)
        q = q[: md.num_tokens]
        if cpu_kernels.attention_supported(q, kv_cache):
            token_seq, token_ctx = self._token_context(md)
            return cpu_kernels.paged_attention(
                q, kv_cache, md.block_tables, token_seq, token_ctx, scale, window, softcap
            )
        if md.is_all_decode:
            return self._decode(q, kv_cache, md, scale, k_scale, v_scale, window, softcap)
        out = torch.empty_like(q)
        starts = md.query_start_loc_cpu
        for i, seq_len in enumerate(md.seq_lens_cpu):
            start, end = starts[i], starts[i + 1]
            if end == start:
                continue
            if end - start == seq_len and k.dtype == kv_cache.dtype:
                keys, values = k[start:end], v[start:end]  # no cached prefix: the new K/V
            else:
                keys, values = gather_kv(kv_cache, md.block_tables[i], seq_len)
                keys = from_kv_cache(keys, q.dtype, k_scale)
                values = from_kv_cache(values, q.dtype, v_scale)
            out[start:end] = _attend(q[start:end], keys, values, scale, window, softcap)
        return out

    def _decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        k_scale: float,
        v_scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """One token per sequence. The sequences are sorted by length and attended in up to
        DECODE_GROUPS groups, each padded only to its own longest context: padding a batch
        of mixed lengths to its longest wastes about half of the K/V gathering."""
        plan = self._decode_plan(q, kv_cache, md)
        _, cache_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        rows = kv_cache.view(2 * cache_blocks, -1)  # [2 * cache_blocks, bs * KVH * D]
        workspace = self._get_workspace(plan.workspace_rows, rows)
        num_heads = q.shape[1]
        group = num_heads // num_kv_heads
        q_sorted = q if plan.in_order else q.index_select(0, plan.order)
        outs = []
        for g in plan.groups:
            n = g.hi - g.lo
            kv = workspace[: g.cache_rows.numel()]
            torch.index_select(rows, 0, g.cache_rows, out=kv)
            kv = kv.view(2, n, g.num_blocks * block_size, num_kv_heads, head_dim)
            keys = from_kv_cache(kv[0], q.dtype, k_scale)  # [n, L, KVH, D]
            values = from_kv_cache(kv[1], q.dtype, v_scale)
            # The query heads sharing a KV head become that head's query rows, so each KV
            # head is read once: [n, KVH, group, D] against [n, KVH, L, D].
            out = _sdpa(
                q_sorted[g.lo : g.hi].view(n, num_kv_heads, group, head_dim),
                keys.transpose(1, 2),
                values.transpose(1, 2),
                g.mask if window is None else g.window_mask(window),
                scale,
                softcap,
            )
            outs.append(out.reshape(n, num_heads, head_dim))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out if plan.in_order else out.index_select(0, plan.inverse)

    def _token_context(self, md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query token's sequence and how many cached positions it sees (int32 [T]
        each), built by a step's first layer (keyed on its metadata, which it holds)."""
        key = self._context_key
        if key is None or key[0] is not md.query_start_loc_cpu or key[1] is not md.seq_lens_cpu:
            starts, seq, ctx = md.query_start_loc_cpu, [], []
            for i, seq_len in enumerate(md.seq_lens_cpu):
                new = starts[i + 1] - starts[i]
                seq += [i] * new
                ctx += range(seq_len - new + 1, seq_len + 1)
            self._context = (
                torch.tensor(seq, dtype=torch.int32),
                torch.tensor(ctx, dtype=torch.int32),
            )
            self._context_key = (md.query_start_loc_cpu, md.seq_lens_cpu)  # md.sliding's too
        return self._context

    def _cos_sin(
        self,
        positions: torch.Tensor,
        dtype: torch.dtype,
        md: AttentionMetadata,
        spec: AttentionSpec,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables of this step's positions, built by its first layer: keyed on the
        metadata and positions objects all layers of a step share (held, so never reused)."""
        key = (md.seq_lens_cpu, positions, spec.rotary_emb.cos_sin_cache, dtype)
        if self._rotation_key is None or any(map(operator.is_not, key, self._rotation_key)):
            self._rotation = spec.rotary_emb.cos_sin(positions, dtype)
            self._rotation_key = key
        assert self._rotation is not None
        return self._rotation

    def _decode_plan(
        self, q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata
    ) -> _DecodePlan:
        # Two plans are kept: a model with full and sliding layers (core/hybrid_kv.py) reads
        # two block tables a step, md and md.sliding, in turn.
        key = (md, kv_cache.shape, kv_cache.device, q.dtype)
        for cached, plan in self._plans:
            if cached[0] is md and cached[1:] == key[1:]:
                return plan
        plan = _build_decode_plan(md, kv_cache.shape[1], kv_cache.shape[2], q)
        self._plans = [(key, plan), *self._plans[:1]]
        return plan

    def _get_workspace(self, num_rows: int, rows: torch.Tensor) -> torch.Tensor:
        ws = self._workspace
        if (
            ws is None
            or ws.shape[0] < num_rows
            or ws.shape[1:] != rows.shape[1:]
            or ws.dtype != rows.dtype
            or ws.device != rows.device
        ):
            ws = torch.empty(num_rows, rows.shape[1], dtype=rows.dtype, device=rows.device)
            self._workspace = ws
        return ws


def _build_decode_plan(
    md: AttentionMetadata, cache_blocks: int, block_size: int, q: torch.Tensor
) -> _DecodePlan:
    num_seqs, lens = md.num_seqs, md.seq_lens_cpu
    num_groups = min(DECODE_GROUPS, num_seqs)
    order_cpu = sorted(range(num_seqs), key=lens.__getitem__)
    order = torch.tensor(order_cpu, device=q.device)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(num_seqs, device=q.device)
    bounds = [num_seqs * g // num_groups for g in range(num_groups + 1)]
    groups = []
    for lo, hi in itertools.pairwise(bounds):
        num_blocks = -(-lens[order_cpu[hi - 1]] // block_size)
        seqs = order[lo:hi]
        blocks = md.block_tables[seqs, :num_blocks].long().flatten()  # [n * nb]
        positions = torch.arange(num_blocks * block_size, device=q.device)
        past = positions[None, :] >= md.seq_lens[seqs][:, None]  # [n, L]
        mask = torch.zeros(past.shape, dtype=q.dtype, device=q.device).masked_fill_(
            past, float("-inf")
        )
        cache_rows = torch.cat([blocks, blocks + cache_blocks])
        groups.append(
            _DecodeGroup(lo, hi, num_blocks, cache_rows, mask[:, None, None, :], md.seq_lens[seqs])
        )
    most = max(g.cache_rows.numel() for g in groups)
    in_order = order_cpu == list(range(num_seqs))
    return _DecodePlan(order, inverse, in_order, groups, most)


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of the last q_len positions of a context over the whole context
    (over each one's last `window` positions, with a window).

    q: [q_len, H, D]; keys/values: [ctx_len, KVH, D]; returns [q_len, H, D].
    """
    q_len, ctx_len = q.shape[0], keys.shape[0]
    # 4-D with an explicit mask: torch's fused CPU kernel takes that with GQA, while 3-D
    # inputs or is_causal with GQA fall back to the unfused math path (several times slower).
    qh, kh, vh = q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    # Query j sits at context position ctx_len - q_len + j and sees positions <= it.
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)[:, None]
    mask = torch.arange(ctx_len, device=q.device)[None, :] <= q_pos  # [q_len, ctx_len]
    if window is not None:
        mask &= torch.arange(ctx_len, device=q.device)[None, :] > q_pos - window
    out = _sdpa(qh, kh, vh, mask, scale, softcap, gqa=True)
    return out[0].transpose(0, 1)


def _sdpa(q, k, v, mask, scale: float, softcap: float | None, gqa: bool = False):
    """SDPA, or with a soft cap on the scores the same in plain float32 ops (SDPA has no
    hook for it). `mask` is boolean (True: attend) or additive."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scores = q.float() @ k.float().transpose(-1, -2) * scale
    scores = softcap * torch.tanh(scores / softcap)
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask
    return (scores.softmax(-1) @ v.float()).to(q.dtype)
