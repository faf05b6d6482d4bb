"""What the device can run, checked before anything loads: fp8 for weights (quantization) and
for the KV cache alike. Torch-free at import: the CLI checks options before loading torch."""

from __future__ import annotations

import os
import time
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


AUTO_THREADS = "the cores this process may use"  # cpu_threads' source when none was asked for


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
        return usable_cores(), AUTO_THREADS
    try:
        count = int(requested)
    except (TypeError, ValueError):
        count = 0
    if isinstance(requested, bool) or count < 1:
        raise ValueError(f"{source} must be an integer >= 1, got {requested!r}")
    return count, source


class ThreadGovernor:
    """Follows the cores that other processes leave free: with 2 OpenMP threads on 2 cores
    and one core busy elsewhere, every parallel op waits for the thread that shares the busy
    core (the embedded model: 85 tok/s quiet, 24-31 busy; one thread: 64 either way). Every
    `period` seconds it reads how busy this process's cores were (/proc/stat) less this
    process's own time (/proc/self/stat), and gives torch `cores - round(foreign)` threads,
    at least 1. For the CPU path when no thread count was asked for."""

    def __init__(self, cores: int, period: float = 1.0) -> None:
        self.cores, self.period = cores, period
        self.threads = cores
        self.cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self._last = self._sample()

    def tick(self) -> None:
        """Called often (each engine step); acts at most once a period."""
        if self._last is None or time.monotonic() - self._last[0] < self.period:
            return
        now = self._sample()
        if now is None:
            return
        elapsed_ticks = (now[0] - self._last[0]) * _CLOCK_TICKS
        foreign = ((now[1] - self._last[1]) - (now[2] - self._last[2])) / max(elapsed_ticks, 1)
        self._last = now
        # Hysteresis: a neighbour's half core is noise, most of one core is a busy neighbour.
        wanted = max(1, min(self.cores, self.cores - int(foreign + 0.3)))
        if wanted != self.threads:
            import torch

            self.threads = wanted
            torch.set_num_threads(wanted)

    def _sample(self) -> tuple[float, int, int] | None:
        """(monotonic time, busy ticks of this process's cores, this process's ticks)."""
        try:
            busy = 0
            with open("/proc/stat") as f:
                for line in f:
                    name, *fields = line.split()
                    if name[3:].isdigit() and name.startswith("cpu") and int(name[3:]) in self.cpus:
                        v = [int(x) for x in fields]
                        busy += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
            with open("/proc/self/stat") as f:
                own = f.read().rsplit(")", 1)[1].split()
            return time.monotonic(), busy, int(own[11]) + int(own[12])  # utime + stime
        except (OSError, ValueError, IndexError):
            return None  # no procfs: leave the threads as they are


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
