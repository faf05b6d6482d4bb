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
