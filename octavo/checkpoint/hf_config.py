"""The model's HF config, from an HF directory, a config.json, or a GGUF file's metadata
(model/config.py reads facts from it)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from octavo.model.registry import get_architecture, hf_architecture_for_gguf

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def load_hf_config(model: str) -> PretrainedConfig:
    """Loads the config of `model`: a `.gguf` file, an HF directory or a config.json path.

    Raises:
        ValueError: the path does not exist, or names an unsupported architecture.
    """
    if not os.path.exists(model):
        raise ValueError(f"model path {model!r} does not exist")
    if model.endswith(".gguf"):
        config = gguf_to_hf_config(model)
    else:
        if os.path.isdir(model) and not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"model directory {model!r} has no config.json")
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(model)
        except (OSError, KeyError) as e:  # transformers' errors for unreadable/unknown configs
            raise ValueError(f"cannot read an HF config from {model!r}: {e}") from e
    get_architecture(config)  # raises ValueError if unsupported
    return config


class GGUFConfig:
    """A config read from a GGUF file: the fields octavo's models read, named as in
    transformers 5's LlamaConfig (`rope_parameters` holds theta and scaling).

    NOTE: a plain object, not a transformers config: importing transformers takes about a
    second, most of a GGUF model's start-up, and nothing here needs it.
    """

    def __init__(self, model_type: str, **fields: Any) -> None:
        self.model_type = model_type
        self.__dict__.update(fields)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"GGUFConfig({self.__dict__!r})"


def gguf_to_hf_config(path: str) -> GGUFConfig:
    """Builds an HF config from a GGUF file's metadata and tensor list.

    NOTE: the lm_head is tied exactly when the file has no `output.weight`. A `rope_freqs`
    tensor (llama.cpp's form of Llama 3.1 rope scaling) becomes `config.rope_freq_factors`.
    """
    from octavo.checkpoint.gguf import open_gguf
    from octavo.checkpoint.gguf_blocks import dequantize_tensor

    gguf_file = open_gguf(path)
    meta = gguf_file.metadata
    arch = meta.get("general.architecture")
    hf_arch = hf_architecture_for_gguf(str(arch))
    tensors = gguf_file.tensors

    def get(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)

    num_heads = int(get("attention.head_count"))
    try:
        num_kv_heads = int(get("attention.head_count_kv", num_heads))
    except TypeError as e:  # a list: one count per layer
        raise ValueError(f"{path}: per-layer KV head counts are not supported") from e
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", get("rope.dimension_count", hidden // num_heads)))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"{path}: partial rotary embeddings are not supported")
    kwargs = {
        "architectures": [hf_arch],
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": int(get("context_length", 2048)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "hidden_act": "silu",
        "vocab_size": int(tensors["token_embd.weight"].shape[0]),  # HF order: [vocab, hidden]
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    if arch == "llama":
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensors
        kwargs["mlp_bias"] = "blk.0.ffn_gate.bias" in tensors
    kwargs |= _gguf_experts(get, str(arch))
    scaling = _gguf_rope_scaling(get) or {"rope_type": "default"}
    kwargs["rope_parameters"] = {"rope_theta": float(get("rope.freq_base", 10000.0))} | scaling
    if arch in ("gemma2", "gemma3"):
        kwargs |= _gguf_gemma(get, str(arch), kwargs)
    if arch == "phi3":
        kwargs |= _gguf_phi3(get, tensors, kwargs)
    config = GGUFConfig(str(arch), **kwargs)
    if "rope_freqs.weight" in tensors:
        config.rope_freq_factors = dequantize_tensor(tensors["rope_freqs.weight"]).tolist()
    return config


def _gguf_experts(get, arch: str) -> dict[str, Any]:
    """A mixture of experts' config fields from GGUF metadata ({} for a dense model): a
    qwen3moe file (llama.cpp's has no dense layers), or a llama file with experts (Mixtral)."""
    experts = int(get("expert_count", 0) or 0)
    if not experts:
        return {}
    fields: dict[str, Any] = {"num_experts_per_tok": int(get("expert_used_count"))}
    if arch == "llama":
        return fields | {"architectures": ["MixtralForCausalLM"], "num_local_experts": experts}
    return fields | {
        "num_experts": experts, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
        "norm_topk_prob": bool(get("expert_weights_norm", True)),
    }  # fmt: skip


def _gguf_phi3(get, tensors, fields: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's longrope, from llama.cpp's `rope_factors_long` / `_short` tensors, and its
    sliding window."""
    from octavo.checkpoint.gguf_blocks import dequantize_tensor

    out: dict[str, Any] = {}
    if "rope_factors_long.weight" in tensors:
        original = get("rope.scaling.original_context_length", fields["max_position_embeddings"])
        out["rope_parameters"] = {
            "rope_theta": float(get("rope.freq_base", 10000.0)), "rope_type": "longrope",
            "long_factor": dequantize_tensor(tensors["rope_factors_long.weight"]).tolist(),
            "short_factor": dequantize_tensor(tensors["rope_factors_short.weight"]).tolist(),
            "original_max_position_embeddings": int(original),
            "attention_factor": get("rope.scaling.attn_factor"),
        }  # fmt: skip
    if get("attention.sliding_window") is not None:
        out["sliding_window"] = int(get("attention.sliding_window"))
    return out


def _gguf_gemma(get, arch: str, fields: dict[str, Any]) -> dict[str, Any]:
    """Gemma's config fields as llama.cpp reads its files: sliding layers every other one
    (gemma2) or all but every sixth (gemma3), whose rope base is 10,000; the query scale
    1 / sqrt(head_dim), but 1 / sqrt(hidden / heads) for the 27B models (46 and 62 layers)."""
    layers, head_dim = fields["num_hidden_layers"], fields["head_dim"]
    big = layers == (46 if arch == "gemma2" else 62)
    scalar = fields["hidden_size"] // fields["num_attention_heads"] if big else head_dim
    if arch == "gemma2":
        kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    else:
        kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                 for i in range(layers)]  # fmt: skip
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar,
        "sliding_window": int(get("attention.sliding_window", fields["max_position_embeddings"])),
        "layer_types": kinds,
        "attn_logit_softcapping": get("attn_logit_softcapping"),
        "final_logit_softcapping": get("final_logit_softcapping"),
    }  # fmt: skip
    if arch == "gemma3":
        out["rope_parameters"] = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": fields["rope_parameters"],
        }
    return out


def _gguf_rope_scaling(get) -> dict | None:
    """GGUF `rope.scaling.*` keys as an HF rope-scaling dict (None for plain rope)."""
    rope_type = get("rope.scaling.type")
    if rope_type in (None, "none"):
        return None
    scaling = {"rope_type": str(rope_type), "factor": float(get("rope.scaling.factor", 1.0))}
    original = get("rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling
