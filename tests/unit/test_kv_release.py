"""Giving the memory of free KV blocks back to the system (kv_setup.release_kv_pages): the
pages of the given blocks read as zeros again and leave the process's resident set; every
other byte stays as it was."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from octavo.runner.kv_setup import release_kv_pages, zeroed_kv_cache

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="madvise's zeroing is Linux's"
)


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


# float32 elements a block: whole pages; 0.68 of a page
@pytest.mark.parametrize("block_elems", [mmap.PAGESIZE, mmap.PAGESIZE * 17 // 100])
def test_released_blocks_read_zeros_and_the_others_keep_their_values(block_elems):
    num_blocks = 64
    cache = zeroed_kv_cache((2, num_blocks, block_elems, 1, 1), torch.float32, torch.device("cpu"))
    values = torch.randn(cache.shape)
    cache.copy_(values)
    freed = [3, 4, 5, 9, 40, 41, 42, 43, 44, 45, 46, 47]
    released = release_kv_pages([cache], [False], {False: freed, True: []})
    block = block_elems * 4
    zeroed = (cache == 0).all(dim=(2, 3, 4))  # [2, num_blocks]: a whole block reads zeros
    changed = (cache != values).flatten(2).any(dim=2)
    if block % mmap.PAGESIZE == 0:
        assert released == 2 * len(freed) * block
        assert zeroed[:, freed].all()
        kept = [b for b in range(num_blocks) if b not in freed]
        assert not changed[:, kept].any()
    else:  # only whole pages inside a run of consecutive blocks
        assert 0 < released < 2 * len(freed) * block
        assert zeroed[:, 42].all()  # inside the run 40-47, whole pages round it
        assert not changed[:, [0, 1, 2, 20, 60]].any()  # far from any given block
    assert released % mmap.PAGESIZE == 0


def test_released_pages_leave_the_resident_set():
    cache = zeroed_kv_cache((2, 512, 16384), torch.float32, torch.device("cpu"))  # 64 MiB
    cache.fill_(1.0)  # every page mapped
    before = resident_bytes()
    release_kv_pages([cache], [False], {False: list(range(512)), True: []})
    assert before - resident_bytes() > 56 * 2**20
    assert cache.abs().sum() == 0
    cache[:, 7].fill_(2.0)  # written again: mapped afresh
    assert cache[:, 7].eq(2.0).all() and cache[:, 6].eq(0).all()


def test_each_pool_releases_its_own_ids():
    caches = [zeroed_kv_cache((2, 8, 1024), torch.float32, torch.device("cpu")) for _ in range(2)]
    for cache in caches:
        cache.fill_(1.0)
    release_kv_pages(caches, [False, True], {False: [1], True: [6]})
    full, sliding = (c.eq(0).all(dim=(0, 2)).tolist() for c in caches)
    assert full == [i == 1 for i in range(8)]
    assert sliding == [i == 6 for i in range(8)]


def test_caches_off_the_cpu_are_left_alone():
    cache = torch.empty((2, 8, 1024), device="meta")
    assert release_kv_pages([cache], [False], {False: [0, 1, 2], True: []}) == 0
