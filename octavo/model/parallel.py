"""Tensor parallelism as the layers see it: this process's rank among the model's shards and
the two collectives the sharded layers call.

A process that runs a whole model (world size 1) never touches torch.distributed; a tensor-
parallel worker sets the group once, before it builds its shard (runner/worker.py).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    # Mixture-of-experts layers: each rank holds E / size whole experts, not a slice of each.
    expert_parallel: bool = False


_tp = TPGroup()
# (a bf16 buffer in torch symmetric memory, its group's name): see use_symmetric_memory.
_symm: tuple[torch.Tensor, str] | None = None
SYMM_MAX_BYTES = 8 << 20
# Deterministic mode (runner/deterministic.py): all-reduces over > 2 ranks sum in rank order.
_fixed_order = False
# all_gather_into_tensor's newer name (torch >= 2.13), else the older one.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def get_tp() -> TPGroup:
    return _tp


def set_tp(
    rank: int, size: int, group: dist.ProcessGroup | None, expert_parallel: bool = False
) -> None:
    global _tp
    _tp = TPGroup(rank, size, group, expert_parallel)


def shard_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """(start, count) of rank's equal share of `total` rows; `total` divisible by `size`."""
    count = total // size
    return rank * count, count


def kv_head_range(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """(first KV head, count) a rank holds: an equal share when there are at least as many
    KV heads as ranks, else one head that `size // num_kv_heads` ranks each keep a copy of."""
    if num_kv_heads >= size:
        return shard_range(num_kv_heads, rank, size)
    return rank * num_kv_heads // size, 1


def check_tp_size(num_heads: int, num_kv_heads: int, size: int) -> None:
    """Raises ValueError unless the heads split evenly over `size` ranks."""
    if num_heads % size:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the model's {num_heads} attention heads"
        )
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={size} and the model's {num_kv_heads} KV heads: one must "
            "divide the other"
        )


def use_symmetric_memory(device: torch.device) -> bool:
    """Lets all-reduces of up to SYMM_MAX_BYTES of bf16 run in one shot over torch symmetric
    memory, each GPU reading its peers' copies (no NVLink multicast): a decode step's small
    messages then take a few us each instead of NCCL's ~15. Off with OCTAVO_SYMM_MEM=0, or
    where the rendezvous fails (NCCL then takes every all-reduce). Called by every rank."""
    global _symm
    if os.environ.get("OCTAVO_SYMM_MEM", "1") == "0":
        return False
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buffer = symm_mem.empty(SYMM_MAX_BYTES // 2, dtype=torch.bfloat16, device=device)
        symm_mem.rendezvous(buffer, _tp.group.group_name)
        _symm = (buffer, _tp.group.group_name)
    except (ImportError, RuntimeError, AttributeError) as e:
        logger.warning("symmetric-memory all-reduce unavailable, NCCL takes all: %s", e)
        _symm = None
    return _symm is not None


def use_fixed_order_sums() -> None:
    """From now on this process's all-reduces give each element the same sum whatever the
    message size: NCCL's and gloo's chunk each message by its size, and with more than two
    ranks a chunk's order of additions follows its place. Two ranks add one pair, which
    gives the same bits in either order, so they keep the fast paths."""
    global _fixed_order
    _fixed_order = True


def _sum_in_rank_order(x: torch.Tensor) -> torch.Tensor:
    """all_reduce's fixed-order form: every rank's x gathered, then added rank 0, 1, ...
    in float32, rounded once."""
    parts = torch.empty((_tp.size, *x.shape), dtype=x.dtype, device=x.device)
    _all_gather(parts.view(-1), x.contiguous().view(-1), group=_tp.group)
    total = parts[0].float()
    for part in parts[1:]:
        total += part
    return x.copy_(total)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums x over the ranks, in place (a no-op at world size 1)."""
    if _tp.size == 1:
        return x
    if _fixed_order and _tp.size > 2:
        return _sum_in_rank_order(x)
    if _symm is not None and x.dtype == torch.bfloat16 and x.numel() * 2 <= SYMM_MAX_BYTES:
        buffer, group_name = _symm
        staged = buffer[: x.numel()]
        staged.copy_(x.view(-1))
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", group_name, x.view(-1))
        return x
    dist.all_reduce(x, group=_tp.group)
    return x


def all_gather_columns(x: torch.Tensor) -> torch.Tensor:
    """[R, C] on each rank -> [R, size * C], rank r's columns r * C .. (r + 1) * C - 1."""
    if _tp.size == 1:
        return x
    out = torch.empty((_tp.size * x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
    _all_gather(out, x.contiguous(), group=_tp.group)
    return out.view(_tp.size, *x.shape).permute(1, 0, 2).reshape(x.shape[0], -1)


def broadcast_from_first(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's x on every rank, in place (a no-op at world size 1)."""
    if _tp.size > 1:
        dist.broadcast(x, src=dist.get_global_rank(_tp.group, 0), group=_tp.group)
    return x
