"""Attention backends by name, imported lazily so the CPU path never imports Triton."""

from __future__ import annotations

from octavo.attention.backend import AttentionBackend


def get_attention_backend(name: str) -> AttentionBackend:
    """A new backend of that name: "torch" (the CPU's, and the kernels' oracle) or "triton"."""
    if name == "torch":
        from octavo.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from octavo.attention.triton_backend import TritonAttentionBackend  # type: ignore

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch' or 'triton'")
