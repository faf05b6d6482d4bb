"""Llama-family decoders: Llama (SmolLM2, Llama 3.x), Mistral, Qwen2 / Qwen2.5, Qwen3, Phi-3.

They share one implementation; class attributes and the config pick the differences:

    Llama   qkv bias from `attention_bias` (usually off)
    Qwen2   qkv bias always on; untied lm_head in most sizes
    Qwen3   RMSNorm on each q and k head before rope; explicit head_dim
    Phi-3   q/k/v and gate/up stored fused in the checkpoint; "longrope" rope

Input is a flat batch of T tokens (no padding); the attention layer reads the paged KV
cache through the explicit AttentionMetadata. Under tensor parallelism each rank builds its
shard: its share of the heads and of the MLP's columns (model/parallel.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from octavo.attention.backend import AttentionMetadata
from octavo.attention.layer import Attention
from octavo.model.config import (
    get_head_dim,
    get_num_kv_heads,
    get_rope_scaling,
    get_rope_theta,
    layer_windows,
)
from octavo.model.layers import (
    LMHead,
    MergedLinear,
    QKVLinear,
    RMSNorm,
    RowParallelLinear,
    SiluAndMul,
    VocabEmbedding,
    default_weight_loader,
)
from octavo.model.parallel import check_tp_size, get_tp, kv_head_range
from octavo.model.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Checkpoint projection name -> (fused parameter's module, shard id).
STACKED_PARAMS: dict[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}

# Checkpoint tensors that hold no weights of ours (HF recomputes these buffers).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaAttention(nn.Module):
    """Self-attention: fused qkv projection, then paged attention (which applies the optional
    q/k norm and rope, see octavo/attention/backend.py), then the output projection.

    q_norm, k_norm and rotary_emb are attributes of this module, so their parameters keep the
    checkpoint's names (`self_attn.q_norm.weight`); `attn` holds them by reference.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        qkv_bias: bool,
        qk_norm: bool,
        rope: tuple[float, dict | None] | None = None,
        scale: float | None = None,
        norm: type[RMSNorm] = RMSNorm,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        """rope (base, scaling) and scale (head_dim ** -0.5) default to the config's; `norm`
        is the q/k norms' class; a sliding window limits what a token attends to, and
        `logit_softcap` caps the scores (Gemma 2)."""
        super().__init__()
        num_heads, num_kv_heads = config.num_attention_heads, get_num_kv_heads(config)
        tp = get_tp()
        check_tp_size(num_heads, num_kv_heads, tp.size)
        self.num_heads = num_heads // tp.size  # this rank's heads
        self.num_kv_heads = kv_head_range(num_kv_heads, tp.rank, tp.size)[1]
        self.head_dim = get_head_dim(config)
        hidden = config.hidden_size
        self.qkv_proj = QKVLinear(hidden, self.head_dim, num_heads, num_kv_heads, qkv_bias)
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = norm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = norm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        base, scaling = rope or (get_rope_theta(config), get_rope_scaling(config))
        self.rotary_emb = RotaryEmbedding(
            self.head_dim,
            config.max_position_embeddings,
            base,
            scaling,
            getattr(config, "rope_freq_factors", None),
        )
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim,
            self.head_dim**-0.5 if scale is None else scale,
            self.rotary_emb, self.q_norm, self.k_norm, sliding_window, logit_softcap,
        )  # fmt: skip

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [T, (H + 2 * KVH) * D]
        out = self.attn(qkv, positions, md)  # [T, H * D]
        return self.o_proj(out)  # [T, hidden]


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; only 'silu'")
        bias = bool(getattr(config, "mlp_bias", False))
        inter = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [inter, inter], bias=bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # [T, 2I] -> [T, I] -> [T, h]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual add is fused into the next norm."""

    def __init__(
        self,
        config: PretrainedConfig,
        qkv_bias: bool,
        qk_norm: bool,
        mlp: nn.Module,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, qkv_bias, qk_norm, sliding_window=sliding_window)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        md: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = attention_block(self, positions, hidden, residual, md)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


def attention_block(
    layer: nn.Module,
    positions: torch.Tensor,
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    md: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's input norm (with the residual add carried from the layer before:
    the stream is residual + hidden) and its self-attention -> (attention output, residual)."""
    if residual is None:
        residual = hidden
        hidden = layer.input_layernorm(hidden)
    else:
        hidden, residual = layer.input_layernorm(hidden, residual)
    return layer.self_attn(positions, hidden, md), residual


@functools.cache
def _rounded(x: float, dtype: torch.dtype) -> float:
    return torch.tensor(x, dtype=dtype).item()


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm: token ids [T] -> hidden states [T, hidden]."""

    def __init__(
        self,
        config: PretrainedConfig,
        make_layer: Callable[[PretrainedConfig, int], nn.Module],
        norm: type[RMSNorm] = RMSNorm,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(make_layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = norm(config.hidden_size, config.rms_norm_eps)
        self.embed_scale: float | None = None  # Gemma: the embeddings times sqrt(hidden_size)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        if self.embed_scale is not None:  # the factor rounded to the dtype, as HF multiplies
            hidden = hidden * _rounded(self.embed_scale, hidden.dtype)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, md)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM over a flat, unpadded batch.

    Parameters are created in the default dtype and device, which the loader sets.
    """

    force_qkv_bias = False  # Qwen2 always has q/k/v biases, whatever the config says
    qk_norm = False  # Qwen3 normalizes each q/k head

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.qkv_bias = self.force_qkv_bias or bool(getattr(config, "attention_bias", False))
        self.model = LlamaModel(config, self.make_layer, self.norm)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    norm: type[RMSNorm] = RMSNorm  # the final norm's class

    def make_layer(self, config: PretrainedConfig, layer: int) -> nn.Module:
        """Decoder layer `layer` (Gemma's differ)."""
        return LlamaDecoderLayer(
            config, self.qkv_bias, self.qk_norm, self.make_mlp(config, layer),
            layer_windows(config)[layer],
        )  # fmt: skip

    def make_mlp(self, config: PretrainedConfig, layer: int) -> nn.Module:
        """The feed-forward block of decoder layer `layer` (mixture-of-experts models'
        differ)."""
        return LlamaMLP(config)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden] (before the LM head)."""
        return self.model(input_ids, positions, md)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in the model's dtype."""
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies HF-named checkpoint tensors into the parameters, routing q/k/v and
        gate/up into their fused parameters through STACKED_PARAMS.

        Returns the names of the parameters that got all their pieces.
        Raises ValueError for a checkpoint name this model has no parameter for.
        """
        params = dict(self.named_parameters())
        shards_seen: dict[str, set] = {}
        for name, tensor in weights:
            if name.endswith(IGNORED_SUFFIXES):
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue  # tied: the head is the embedding, some checkpoints store both
            param_name, shard_id = self.route(name)
            if param_name not in params:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of the model")
            param = params[param_name]
            if shard_id is None:
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, tensor)
            else:
                param.weight_loader(param, tensor, shard_id)
            shards_seen.setdefault(param_name, set()).add(shard_id)
        return {
            name
            for name, seen in shards_seen.items()
            if seen >= set(getattr(params[name], "shard_ids", (None,)))
        }

    def route(self, name: str) -> tuple[str, str | int | tuple | None]:
        """'model.layers.0.self_attn.k_proj.weight' -> ('model.layers.0.self_attn.qkv_proj.weight',
        'k'); names of unfused parameters come back unchanged with shard id None."""
        for ckpt_name, (fused_name, shard_id) in STACKED_PARAMS.items():
            if f".{ckpt_name}." in name:
                return name.replace(f".{ckpt_name}.", f".{fused_name}."), shard_id
        return name, None


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama, with a sliding window on every layer where the config sets one
    (Mistral 7B v0.1)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5: Llama with q/k/v biases."""

    force_qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with per-head RMSNorm on q and k (qkv bias only if attention_bias)."""

    qk_norm = True


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 (and Phi-3.5, Phi-4-mini's layout): Llama whose checkpoints store q/k/v as one
    `qkv_proj` tensor and gate/up as one `gate_up_proj`, split here into the shards the
    fused parameters load (so that tensor parallelism slices each); rope may be "longrope"
    (model/rotary.py)."""

    def __init__(self, config: PretrainedConfig) -> None:
        scaling = get_rope_scaling(config) or {}
        if scaling.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(
                "a partial rotary embedding (partial_rotary_factor < 1) is not supported"
            )
        super().__init__(config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights):
        config = self.config
        head_dim = get_head_dim(config)
        q = config.num_attention_heads * head_dim
        kv = get_num_kv_heads(config) * head_dim
        inter = config.intermediate_size
        # Fused name -> (part, first row, rows) of each checkpoint projection it holds.
        splits = {
            ".qkv_proj.": (("q", 0, q), ("k", q, kv), ("v", q + kv, kv)),
            ".gate_up_proj.": (("gate", 0, inter), ("up", inter, inter)),
        }
        for name, tensor in weights:
            fused = next((f for f in splits if f in name), None)
            if fused is None:
                yield name, tensor
                continue
            for part, start, size in splits[fused]:
                yield name.replace(fused, f".{part}_proj."), tensor.narrow(0, start, size)
