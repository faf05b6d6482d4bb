"""Programmatic dependent launch (PDL), on Hopper and later GPUs.

A kernel launched with PDL may be scheduled while the kernel before it in the stream is still
draining, instead of after it has finished and flushed its writes. Every kernel of ours that
takes `USE_PDL` first waits for that flush (`gdc_wait`, the `griddepcontrol.wait`
instruction) and only then reads anything, so results are the same either way; what is saved
is the launch latency at each kernel boundary, inside CUDA graphs too.

`ENABLED` is read at every launch: benchmarks flip it to compare (environment:
OCTAVO_PDL=0 turns it off).
"""

from __future__ import annotations

import functools
import os

import torch

ENABLED = os.environ.get("OCTAVO_PDL", "1") != "0"


@functools.cache
def _hopper_or_later(device_index: int) -> bool:
    if torch.version.hip is not None:  # ROCm reports its own "capability" (MI300: 9.4)
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """True if kernels on `device` should launch with PDL."""
    if not ENABLED or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _hopper_or_later(index)


def pdl_args(device: torch.device) -> dict[str, bool]:
    """Launch keywords for a kernel that takes `USE_PDL`: the flag and Triton's option."""
    on = pdl_enabled(device)
    return {"USE_PDL": on, "launch_pdl": on}
