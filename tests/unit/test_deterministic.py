"""Deterministic mode's pieces that run without a GPU: the span length, what the mode
refuses, the CPU's answer to deterministic=True, and the rank-ordered all-reduce over gloo
(three ranks: the case where NCCL's and gloo's order follows the message size)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from octavo.model import parallel
from octavo.model.moe import FusedMoE
from octavo.runner.deterministic import MAX_SPLITS, MIN_SPLIT, check_deterministic, fixed_split
from octavo.runner.multiproc import free_port


def test_spans_are_a_power_of_two_and_at_most_max_splits_of_the_context():
    for length in [1, 256, 2048, 4096, 4097, 32768, 40960, 131072]:
        split = fixed_split(length)
        assert split >= MIN_SPLIT and split & (split - 1) == 0
        assert -(-length // split) <= MAX_SPLITS
        assert split == MIN_SPLIT or -(-length // (split // 2)) > MAX_SPLITS  # the smallest


def _bf16(*modules: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), *modules).to(torch.bfloat16)


def test_the_mode_refuses_what_it_does_not_cover():
    check_deterministic(_bf16(), "triton", None)  # covered: passes
    with pytest.raises(ValueError, match="Triton attention backend"):
        check_deterministic(_bf16(), "torch", None)
    with pytest.raises(ValueError, match="quantization='int8'"):
        check_deterministic(_bf16(), "triton", "int8")
    with pytest.raises(ValueError, match="mixtures of experts"):
        check_deterministic(_bf16(FusedMoE(4, 2, 8, 8, True)), "triton", None)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        check_deterministic(nn.Linear(4, 4), "triton", None)


def test_the_cpu_path_that_is_not_batch_invariant_is_refused():
    from octavo import LLM

    with pytest.raises(ValueError, match="deterministic=True on the CPU"):
        LLM(dtype="bfloat16", quantization="none", deterministic=True)


def _ranks(rank: int, size: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    parallel.set_tp(rank, size, dist.group.WORLD)
    parallel.use_fixed_order_sums()
    gen = torch.Generator().manual_seed(rank)
    rows = torch.randn(100, 37, generator=gen) * 10.0 ** torch.randint(
        -3, 4, (100, 1), generator=gen
    )
    whole = parallel.all_reduce(rows.clone())
    alone = torch.cat([parallel.all_reduce(rows[i : i + 1].clone()) for i in range(5)])
    if rank == 0:
        torch.save({"whole": whole, "alone": alone}, out)
    dist.barrier()  # every rank done; then out without gloo's teardown, which may abort
    os._exit(0)


def test_three_ranks_sum_each_row_in_rank_order_at_every_message_size():
    size = 3
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.pt")
        init = f"tcp://127.0.0.1:{free_port()}"
        mp.start_processes(_ranks, args=(size, init, out), nprocs=size, start_method="spawn")
        got = torch.load(out)
    parts = []
    for rank in range(size):
        gen = torch.Generator().manual_seed(rank)
        parts.append(
            torch.randn(100, 37, generator=gen)
            * 10.0 ** torch.randint(-3, 4, (100, 1), generator=gen)
        )
    expected = (parts[0] + parts[1]) + parts[2]
    assert torch.equal(got["whole"], expected)
    assert torch.equal(got["alone"], expected[:5])
