"""Which class implements which architecture; model modules are imported only when used."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# HF `architectures[0]` -> (module, class name).
_MODELS: dict[str, tuple[str, str]] = {
    "Gemma2ForCausalLM": ("octavo.model.gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("octavo.model.gemma", "Gemma3ForCausalLM"),
    "LlamaForCausalLM": ("octavo.model.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("octavo.model.llama", "MistralForCausalLM"),
    "Phi3ForCausalLM": ("octavo.model.llama", "Phi3ForCausalLM"),
    "Qwen2ForCausalLM": ("octavo.model.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("octavo.model.llama", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("octavo.model.moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("octavo.model.moe", "MixtralForCausalLM"),
}

# GGUF `general.architecture` -> HF architecture name.
_GGUF_ARCHITECTURES: dict[str, str] = {
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}


def supported_architectures() -> list[str]:
    """The HF architecture names octavo can run."""
    return list(_MODELS)


def hf_architecture_for_gguf(gguf_arch: str) -> str:
    """Maps a GGUF `general.architecture` (e.g. 'llama') to its HF name.

    Raises:
        ValueError: the GGUF architecture is not supported.
    """
    if gguf_arch not in _GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {gguf_arch!r} is not supported; "
            f"supported: {sorted(_GGUF_ARCHITECTURES)}"
        )
    return _GGUF_ARCHITECTURES[gguf_arch]


def get_architecture(config: PretrainedConfig) -> str:
    """The config's `architectures[0]`, checked against the registry.

    Raises:
        ValueError: the config names no architecture or an unsupported one.
    """
    archs = getattr(config, "architectures", None) or []
    if not archs:
        raise ValueError("model config has no 'architectures' entry; cannot pick a model class")
    if archs[0] not in _MODELS:
        raise ValueError(
            f"architecture {archs[0]!r} is not supported; supported: {supported_architectures()}"
        )
    return archs[0]


def get_model_class(config: PretrainedConfig) -> type[nn.Module]:
    """The model class for `config`, importing its module on first use."""
    module_name, class_name = _MODELS[get_architecture(config)]
    return getattr(importlib.import_module(module_name), class_name)
