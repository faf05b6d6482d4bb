"""Gemma 3 (text) and Gemma 2 decoders: the Llama family's attention and projections, with
what Gemma does differently, as HF transformers does it:

    embeddings  scaled by sqrt(hidden_size), the factor rounded to the model's dtype
    norms       RMSNorm times (1 + w), in float32; around both sub-blocks of a layer:
                x += post_attn_norm(attn(input_norm(x))); x += post_ff_norm(mlp(pre_ff_norm(x)))
    MLP         GeGLU: gelu_tanh(gate x) * up x
    attention   scale query_pre_attn_scalar ** -0.5; Gemma 3: RMSNorm (1 + w) on each q / k
                head; rope base per layer kind (sliding layers: rope_local_base_freq)
    logits      Gemma 2: attn_logit_softcapping on the attention scores and
                final_logit_softcapping on the logits (tanh(z / cap) * cap)

Sliding layers attend to the last `sliding_window` positions and keep their KV blocks in a
pool of their own, which gets back the blocks before the window (core/hybrid_kv.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from octavo.attention.backend import AttentionMetadata
from octavo.model.config import get_rope_scaling, get_rope_theta, layer_windows
from octavo.model.layers import MergedLinear, RMSNorm, RowParallelLinear, default_weight_loader
from octavo.model.llama import LlamaAttention, LlamaForCausalLM, attention_block

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class GemmaRMSNorm(RMSNorm):
    """RMSNorm times (1 + w): the parameter holds 1 + w, added on load, so the shared norm
    code and kernels run unchanged. It is float32 in any model dtype, as HF computes 1 + w
    (in bfloat16, 1 + 0.01 would round to 1.0078)."""

    rounds_before_weight = False  # the Triton kernel's order: HF's, as _norm below
    weight_dtype = torch.float32

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self.weight.weight_loader = _load_plus_one

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # HF's order: the float32 product, then one rounding (Llama rounds x first).
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


def _load_plus_one(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    default_weight_loader(param, loaded_weight)
    param.data.copy_(param.data.float() + 1.0)


class GemmaMLP(nn.Module):
    """GeGLU feed-forward: down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        act = getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ValueError(
                f"hidden_activation {act!r} is not supported; only 'gelu_pytorch_tanh'"
            )
        inter = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [inter, inter])
        self.down_proj = RowParallelLinear(inter, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if gate_up.is_cuda:  # one Triton kernel for the split, the gelu and the product
            from octavo.kernels.activation import gelu_tanh_and_mul

            return self.down_proj(gelu_tanh_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


def _rope_of(config: PretrainedConfig, kind: str) -> tuple[float, dict | None]:
    """(base, scaling) of a layer kind: transformers 5 keeps a dict per kind; older Gemma 3
    configs give the sliding layers `rope_local_base_freq`."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get(kind), dict):
        per_kind = params[kind]
        scaling = {k: v for k, v in per_kind.items() if k != "rope_theta"}
        scaling.setdefault("rope_type", "default")
        return float(per_kind["rope_theta"]), (
            None if scaling["rope_type"] == "default" else scaling
        )
    local = getattr(config, "rope_local_base_freq", None)
    if kind == "sliding_attention" and local is not None:
        return float(local), None
    return get_rope_theta(config), get_rope_scaling(config)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer: int, qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(
            config, bool(getattr(config, "attention_bias", False)), qk_norm,
            rope=_rope_of(config, config.layer_types[layer]),
            scale=config.query_pre_attn_scalar**-0.5, norm=GemmaRMSNorm,
            sliding_window=layer_windows(config)[layer],
            logit_softcap=getattr(config, "attn_logit_softcapping", None) or None,
        )  # fmt: skip
        self.mlp = GemmaMLP(config)
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        md: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual): the residual stream is residual + hidden, as in Llama's."""
        hidden, residual = attention_block(self, positions, hidden, residual, md)
        hidden, residual = self.pre_feedforward_layernorm(
            self.post_attention_layernorm(hidden), residual
        )
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text model (Gemma3ForCausalLM checkpoints: 1B, and the text of larger
    ones saved alone)."""

    qk_norm = True
    norm = GemmaRMSNorm

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        self.model.embed_scale = config.hidden_size**0.5

    def make_layer(self, config: PretrainedConfig, layer: int) -> nn.Module:
        return GemmaDecoderLayer(config, layer, self.qk_norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_softcap:
            cap = self.final_softcap
            logits = (torch.tanh(logits.float() / cap) * cap).to(logits.dtype)
        return logits


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2: Gemma 3 without the q/k norms, one rope base, final logit soft-capping."""

    qk_norm = False
