"""Rotary position embedding (HF's "neox", rotate-half layout) with its default, linear and
Llama 3.1 frequency scalings."""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import nn


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's frequency scaling: long wavelengths are slowed by `factor`, short ones
    kept, and the band between interpolated smoothly."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _longrope(
    inv_freq: torch.Tensor, scaling: dict, max_position: int
) -> tuple[torch.Tensor, torch.Tensor, int, float]:
    """Phi-3's "longrope" (LongRoPE): frequencies divided by `short_factor` within the
    original context and by `long_factor` past it, cos and sin scaled by the attention
    factor (HF's default: sqrt(1 + ln(factor) / ln(original)), factor = the context over
    the original). Returns (short, long frequencies, original context, attention factor).

    NOTE: each position takes its own factors, as vLLM does; HF transformers switches the
    whole sequence to the long factors once it passes the original context, so the two
    agree up to the original context."""
    original = scaling["original_max_position_embeddings"]
    short = torch.tensor(scaling["short_factor"], dtype=torch.float32)
    long = torch.tensor(scaling["long_factor"], dtype=torch.float32)
    if len(short) != len(inv_freq) or len(long) != len(inv_freq):
        raise ValueError(f"longrope needs {len(inv_freq)} short and long factors")
    mscale = scaling.get("attention_factor")
    if mscale is None:
        factor = scaling.get("factor") or max_position / original
        mscale = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freq / short, inv_freq / long, original, float(mscale)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the HF ("neox", rotate-half) layout.

    cos/sin are precomputed in float32 for positions 0..max_position-1. `scaling` is an HF
    rope-scaling dict (`rope_type` "default", "linear" or "llama3") or None; `freq_factors`
    divides the frequencies one by one (llama.cpp's `rope_freqs` tensor in GGUF files).

    NOTE: embeddings built with the same frequencies, length and device share one
    `cos_sin_cache` tensor (every layer of a model does), computed once: 30 tables of 8,192
    positions take a noticeable part of a small model's start-up on the CPU. The buffer is
    read-only; `.to()` on a module gives that module its own copy, as for any buffer.
    """

    SUPPORTED = ("default", "linear", "llama3", "longrope")
    # (max_position, frequencies, device, inference mode) -> the table, while a module holds it.
    _tables: ClassVar[weakref.WeakValueDictionary] = weakref.WeakValueDictionary()

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: dict | None = None,
        freq_factors: Sequence[float] | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        # The frequencies on the CPU (they key the shared table, also under a meta device).
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        inv_freq = 1.0 / (base**exponent)  # [D/2]
        rope_type = (scaling or {}).get("rope_type", "default")
        if rope_type not in self.SUPPORTED:
            raise ValueError(
                f"rope_type {rope_type!r} is not supported; use one of {self.SUPPORTED}"
            )
        long_inv_freq, original, mscale = None, max_position, 1.0
        if rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "longrope":
            inv_freq, long_inv_freq, original, mscale = _longrope(inv_freq, scaling, max_position)
        if freq_factors is not None:
            if len(freq_factors) != head_dim // 2:
                raise ValueError(
                    f"expected {head_dim // 2} rope freq factors, got {len(freq_factors)}"
                )
            inv_freq = inv_freq / torch.tensor(
                list(freq_factors), dtype=torch.float32, device="cpu"
            )
        device = torch.get_default_device()  # where the table goes (a `with device:` block)
        key = (
            max_position,
            tuple(inv_freq.tolist()),
            None if long_inv_freq is None else tuple(long_inv_freq.tolist()),
            mscale,
            device,
            torch.is_inference_mode_enabled(),
        )
        cache = self._tables.get(key)
        if cache is None:
            t = torch.arange(max_position, dtype=torch.float32, device=device)
            freqs = torch.outer(t, inv_freq.to(device))  # [P, D/2]
            if long_inv_freq is not None:  # positions past the original context: long ones
                long = torch.outer(t, long_inv_freq.to(device))
                freqs = torch.where(t[:, None] < original, freqs, long)
            cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * mscale  # [P, D]
            self._tables[key] = cache
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos and sin [T, 1, D] in `dtype` for `rotate`, the sin's first
        half negated: computed once per step, they serve every layer."""
        cos, sin = self.cos_sin_cache[positions].to(dtype).chunk(2, dim=-1)  # [T, D/2] each
        return torch.cat([cos, cos], -1).unsqueeze(1), torch.cat([-sin, sin], -1).unsqueeze(1)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H * D] rotated by `cos_sin`'s tables: x cos + rotate_half(x) sin, HF's
        formula, rotate_half's negation carried by the sin (bit for bit the same)."""
        num_tokens = x.shape[0]
        x = x.view(num_tokens, -1, self.head_dim)  # [T, H, D]
        out = x * cos + x.roll(self.head_dim // 2, -1) * sin
        return out.view(num_tokens, -1)  # [T, H * D]

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T]; q: [T, H * D]; k: [T, KVH * D] -> rotated q, k (same shapes)."""
        cos, sin = self.cos_sin(positions, q.dtype)
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)
