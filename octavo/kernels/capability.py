"""What the device can run, checked before anything loads: fp8 for weights (quantization) and
for the KV cache alike. Torch-free at import: the CLI checks options before loading torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def check_fp8_device(option: str, device: torch.device) -> None:
    """Raises ValueError, naming `option`, on a CUDA GPU without FP8 (below sm89)."""
    if device.type != "cuda":
        return
    import torch

    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ValueError(
            f"{option} needs a GPU with FP8 support (compute capability 8.9 or newer); this "
            f"one has {capability[0]}.{capability[1]}"
        )
