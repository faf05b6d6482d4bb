"""Small host lists and tensors onto the device without waiting for it."""

from __future__ import annotations

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on `device`. On CUDA the copy goes from pinned memory
    without waiting (torch.tensor(..., device="cuda") would wait for all queued work)."""
    return upload(torch.tensor(values, dtype=dtype), device)


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, copied as `to_device` copies."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
