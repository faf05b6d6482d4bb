"""How many CPU threads compute: an explicit count, then OCTAVO_NUM_THREADS, then
OMP_NUM_THREADS, then the cores the process may use (affinity, capped by a cgroup quota)."""

from __future__ import annotations

import os

import pytest

from octavo.kernels import capability


def test_the_count_comes_from_the_first_source_that_sets_it(monkeypatch):
    monkeypatch.setenv("OCTAVO_NUM_THREADS", "3")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert capability.cpu_threads(5) == (5, "threads")
    assert capability.cpu_threads(None) == (3, "OCTAVO_NUM_THREADS")
    monkeypatch.delenv("OCTAVO_NUM_THREADS")
    assert capability.cpu_threads(None) == (2, "OMP_NUM_THREADS")
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert capability.cpu_threads(None) == (
        capability.usable_cores(),
        capability.cpu_threads(None)[1],
    )
    assert capability.usable_cores() <= len(os.sched_getaffinity(0))


@pytest.mark.parametrize("bad", ["0", "two", "-1"])
def test_a_bad_count_is_a_value_error_naming_its_source(monkeypatch, bad):
    monkeypatch.setenv("OCTAVO_NUM_THREADS", bad)
    with pytest.raises(ValueError, match="OCTAVO_NUM_THREADS must be an integer >= 1"):
        capability.cpu_threads(None)
    with pytest.raises(ValueError, match="threads must be an integer >= 1"):
        capability.cpu_threads(0)


def test_a_cgroup_quota_caps_the_cores(tmp_path, monkeypatch):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert capability._quota_v2(str(tmp_path / "cpu.max")) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert capability._quota_v2(str(tmp_path / "cpu.max")) is None
    (tmp_path / "cpu.cfs_quota_us").write_text("50000\n")
    (tmp_path / "cpu.cfs_period_us").write_text("100000\n")
    assert capability._quota_v1(str(tmp_path)) == 0.5
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(capability, "_quota_v2", lambda path: 1.5)
    assert capability.usable_cores() == 2  # a quota of 1.5 cores: 2 threads


def test_the_governor_gives_up_the_core_a_neighbour_keeps_busy(monkeypatch):
    """A neighbour busy on one of 2 cores: 1 thread; when it stops: 2 again. Half a core of
    noise changes nothing."""
    import torch

    from octavo.kernels import capability

    samples = iter([
        (0.0, 0, 0),  # at start
        (1.0, 200, 100),  # both cores busy, half of it ours: a neighbour on one core
        (2.0, 300, 200),  # only ours: the neighbour left
        (3.0, 440, 300),  # ours and 0.4 of a core: noise
    ])  # fmt: skip
    monkeypatch.setattr(capability, "_CLOCK_TICKS", 100)
    monkeypatch.setattr(capability.ThreadGovernor, "_sample", lambda self: next(samples))
    monkeypatch.setattr(capability.time, "monotonic", lambda: 10.0)  # every tick is due
    threads = torch.get_num_threads()
    try:
        governor = capability.ThreadGovernor(2, period=0.5)
        seen = []
        for _ in range(3):
            governor.tick()
            seen.append((governor.threads, torch.get_num_threads()))
        assert seen == [(1, 1), (2, 2), (2, 2)]
    finally:
        torch.set_num_threads(threads)


def test_the_governor_runs_only_where_no_thread_count_was_asked(monkeypatch, tmp_path):
    from octavo.kernels.capability import AUTO_THREADS, cpu_threads

    monkeypatch.delenv("OCTAVO_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpu_threads(None)[1] == AUTO_THREADS
    assert cpu_threads(1)[1] != AUTO_THREADS
    monkeypatch.setenv("OCTAVO_NUM_THREADS", "1")
    assert cpu_threads(None)[1] != AUTO_THREADS
