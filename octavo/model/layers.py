"""The building blocks of a decoder: norms, rotary embedding, activation, linear layers.

Every parameter carries a `weight_loader(param, loaded_weight[, shard_id])` that copies one
checkpoint tensor into it. Fused parameters (`qkv_proj`, `gate_up_proj`) take several
checkpoint tensors, each into its own row range:

    qkv_proj.weight  [(H + 2 * KVH) * D, hidden]
    rows: | q: H * D | k: KVH * D | v: KVH * D |

A tensor-parallel version would narrow `loaded_weight` to its rank's slice in the same
loaders; this file implements world size 1.

RMSNorm and SiluAndMul pick their kernel by the input's device, in one `if x.is_cuda` each:
on CUDA one Triton kernel (octavo/kernels, imported there, so the CPU path never imports
Triton), elsewhere the torch code, which is that kernel's reference. Attention's paths are
not chosen here or in the model but by its backend (octavo/attention).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copies a whole checkpoint tensor into `param` (casting to its dtype and device)."""
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, "
            f"parameter expects {tuple(param.shape)}"
        )
    param.data.copy_(loaded_weight)


def _copy_rows(param: torch.Tensor, loaded_weight: torch.Tensor, offset: int, size: int) -> None:
    """Copies `loaded_weight` into rows offset..offset+size of `param` (dim 0)."""
    expected = (size, *param.shape[1:])
    if tuple(loaded_weight.shape) != expected:
        raise ValueError(
            f"checkpoint shard has shape {tuple(loaded_weight.shape)}, expected {expected}"
        )
    param.data.narrow(0, offset, size).copy_(loaded_weight)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like HF's.

    `forward(x, residual)` fuses the residual add of a pre-norm block: it returns
    `(norm(x + residual), x + residual)`, the second being the next residual.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.weight.weight_loader = default_weight_loader

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        orig_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(orig_dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda:  # one Triton kernel instead of ~9 small ones
            from octavo.kernels.rms_norm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


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


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the HF ("neox", rotate-half) layout.

    cos/sin are precomputed in float32 for positions 0..max_position-1. `scaling` is an HF
    rope-scaling dict (`rope_type` "default", "linear" or "llama3") or None; `freq_factors`
    divides the frequencies one by one (llama.cpp's `rope_freqs` tensor in GGUF files).
    """

    SUPPORTED = ("default", "linear", "llama3")

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
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (base**exponent)  # [D/2]
        rope_type = (scaling or {}).get("rope_type", "default")
        if rope_type not in self.SUPPORTED:
            raise ValueError(
                f"rope_type {rope_type!r} is not supported; use one of {self.SUPPORTED}"
            )
        if rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        if freq_factors is not None:
            if len(freq_factors) != head_dim // 2:
                raise ValueError(
                    f"expected {head_dim // 2} rope freq factors, got {len(freq_factors)}"
                )
            inv_freq = inv_freq / torch.tensor(list(freq_factors), dtype=torch.float32)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [P, D]
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        x = x.view(num_tokens, -1, self.head_dim)  # [T, H, D]
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)
        out = x * cos + rotated * sin
        return out.view(num_tokens, -1)  # [T, H * D]

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T]; q: [T, H * D]; k: [T, KVH * D] -> rotated q, k (same shapes)."""
        cos_sin = self.cos_sin_cache[positions].to(q.dtype)  # [T, D]
        cos, sin = cos_sin.chunk(2, dim=-1)  # [T, D/2] each
        cos = torch.cat([cos, cos], dim=-1).unsqueeze(1)  # [T, 1, D]
        sin = torch.cat([sin, sin], dim=-1).unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)


class SiluAndMul(nn.Module):
    """SwiGLU's gate: x [T, 2 * I] -> silu(x[:, :I]) * x[:, I:], [T, I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # one Triton kernel for the split, the silu and the product
            from octavo.kernels.activation import silu_and_mul

            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def _capturing(x: torch.Tensor) -> bool:
    """True while a CUDA graph captures on the current stream of x's device."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


class Linear(nn.Module):
    """y = x W^T (+ b), with W [output_size, input_size]; the base of the fused linears.

    At world size 1 this serves both column- and row-parallel roles (o_proj, down_proj).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copies the whole checkpoint tensor (a TP rank would copy its slice)."""
        default_weight_loader(param, loaded_weight)

    # {rows: fn(x, w)}, a GEMM measured faster than F.linear at that many rows; run only
    # while a CUDA graph captures (runner/gemm_tuning.py). Shared by projections of a shape.
    # fn returns None for an input it cannot take; F.linear runs then.
    tuned: dict[int, Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tuned = self.tuned.get(x.shape[0]) if self.tuned and x.dim() == 2 else None
        if tuned is not None and x.is_contiguous() and _capturing(x):
            y = tuned(x, self.weight)
            if y is not None:
                return y
        return F.linear(x, self.weight, self.bias)


class _FusedLinear(Linear):
    """A Linear whose output rows are several checkpoint tensors laid end to end.

    `shard_ranges` maps a shard id to its (row offset, row count). Each parameter lists its
    `shard_ids`, so a loader can tell when all of a fused parameter's pieces have arrived.
    """

    def __init__(
        self, input_size: int, shard_ranges: dict[str | int, tuple[int, int]], bias: bool
    ) -> None:
        output_size = sum(size for _, size in shard_ranges.values())
        super().__init__(input_size, output_size, bias)
        self.shard_ranges = shard_ranges
        for param in self.parameters():
            param.shard_ids = tuple(shard_ranges)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | int
    ) -> None:
        """Copies one checkpoint tensor (e.g. k_proj's) into its rows of the fused param."""
        if shard_id not in self.shard_ranges:
            raise ValueError(
                f"unknown shard {shard_id!r}; expected one of {list(self.shard_ranges)}"
            )
        offset, size = self.shard_ranges[shard_id]
        _copy_rows(param, loaded_weight, offset, size)


class QKVLinear(_FusedLinear):
    """q, k and v projections in one matmul: [T, hidden] -> [T, (H + 2 * KVH) * D]."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        ranges = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}
        super().__init__(hidden_size, ranges, bias)
        self.q_size, self.kv_size = q_size, kv_size


class MergedLinear(_FusedLinear):
    """Several projections of the same input stacked (gate and up: shard ids 0 and 1)."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False) -> None:
        offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        ranges = {i: (offsets[i], size) for i, size in enumerate(output_sizes)}
        super().__init__(input_size, ranges, bias)


class VocabEmbedding(nn.Module):
    """Token embedding table [vocab, hidden]; its weight may be shared with the LM head."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)  # [T, hidden]


class LMHead(VocabEmbedding):
    """Projects hidden states to logits in the model's dtype: [N, hidden] -> [N, vocab].
    The sampler upcasts to float32 where it computes with them."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)
