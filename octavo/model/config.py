"""Facts read from a model's HF config, the same from transformers 4.x configs (`rope_theta`,
`rope_scaling`) and 5.x configs (one `rope_parameters` dict)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def get_head_dim(config: PretrainedConfig) -> int:
    """`head_dim` when the config sets it (Qwen3), else hidden_size // num_attention_heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def get_num_kv_heads(config: PretrainedConfig) -> int:
    """`num_key_value_heads`, or the attention heads' number when the config has none."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def get_rope_theta(config: PretrainedConfig) -> float:
    """The rope base frequency (10000 when the config names none)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    theta = getattr(config, "rope_theta", None)
    return float(theta) if theta is not None else 10000.0


def get_rope_scaling(config: PretrainedConfig) -> dict | None:
    """The rope-scaling dict (with a `rope_type` key), or None for plain rope."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):
        params = getattr(config, "rope_scaling", None)
    if not params:
        return None
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    rope_type = scaling.pop("type", None)  # old name of the key
    scaling.setdefault("rope_type", rope_type or "default")
    return None if scaling["rope_type"] == "default" else scaling


def get_sliding_window(config: PretrainedConfig) -> int | None:
    """The attention window of a model that slides one (Mistral, Phi-3, Mixtral, Gemma 2 and
    3; Qwen2 and Qwen3 with use_sliding_window), None for full attention. A token attends to
    the last `window` positions, its own included: up to that length, the attention is
    full."""
    window = getattr(config, "sliding_window", None)
    if window is None or not getattr(config, "use_sliding_window", True):
        return None
    return int(window)


def layer_windows(config: PretrainedConfig) -> list[int | None]:
    """Each decoder layer's sliding window, None where it attends to the whole context: the
    layers `layer_types` calls "sliding_attention" (Gemma, Qwen2's upper layers), or every
    layer of a model with a window and no layer kinds (Mistral, Phi-3, Mixtral), as HF's."""
    window = get_sliding_window(config)
    kinds = getattr(config, "layer_types", None)
    if window is None:
        return [None] * config.num_hidden_layers
    if not kinds:
        return [window] * config.num_hidden_layers
    return [window if kind == "sliding_attention" else None for kind in kinds]


def hybrid_window(config: PretrainedConfig) -> int | None:
    """The sliding layers' window of a model that has full-attention layers too (Gemma 2 and
    3): those layers keep KV blocks of their own (core/hybrid_kv.py). None for the others."""
    windows = [w for w in layer_windows(config) if w is not None]
    return max(windows) if windows and len(windows) < config.num_hidden_layers else None
