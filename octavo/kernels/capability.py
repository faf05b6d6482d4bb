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


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup CPU quota (a
    container's `--cpus`), at least 1."""
    import math
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    for path, parse in (("/sys/fs/cgroup/cpu.max", _quota_v2), ("/sys/fs/cgroup/cpu", _quota_v1)):
        try:
            quota = parse(path)
        except (OSError, ValueError):
            continue
        if quota is not None:
            cores = min(cores or 1, max(1, math.ceil(quota)))
            break
    return max(1, cores or 1)


def _quota_v2(path: str) -> float | None:
    quota, period = open(path).read().split()[:2]  # "max 100000" or "150000 100000"
    return None if quota == "max" else int(quota) / int(period)


def _quota_v1(path: str) -> float | None:
    quota = int(open(f"{path}/cpu.cfs_quota_us").read())
    return None if quota < 0 else quota / int(open(f"{path}/cpu.cfs_period_us").read())


def cpu_threads(requested: int | None) -> tuple[int, str]:
    """The CPU threads to compute with, and where the number comes from: `requested`
    (threads=, --threads), else OCTAVO_NUM_THREADS, else OMP_NUM_THREADS, else the usable
    cores.

    Raises:
        ValueError: a count below 1, or an OCTAVO_NUM_THREADS that is not one.
    """
    import os

    if requested is not None:
        source = "threads"
    elif os.environ.get("OCTAVO_NUM_THREADS"):
        requested, source = os.environ["OCTAVO_NUM_THREADS"], "OCTAVO_NUM_THREADS"
    elif os.environ.get("OMP_NUM_THREADS", "").isdigit():
        requested, source = os.environ["OMP_NUM_THREADS"], "OMP_NUM_THREADS"
    else:
        return usable_cores(), "the cores this process may use"
    try:
        count = int(requested)
    except (TypeError, ValueError):
        count = 0
    if isinstance(requested, bool) or count < 1:
        raise ValueError(f"{source} must be an integer >= 1, got {requested!r}")
    return count, source
