"""How many parts decode attention cuts each sequence's context into (split-K, see
decode_attention.py), chosen on the host without Triton, so the CUDA-graph ladder can plan
with it on any machine.

The count fills the GPU about twice over with programs (num_seqs x num_kv_heads x splits).
When the step's contexts are long and the batch's own programs fill between a quarter of a
wave and three waves of SMs, it aims at twice as many programs from a mean context of 2k
and four times as many from 8k: the finer splits even out the SMs' work, which one long
program per sequence does not. Measured on an H200 (docs/PERFORMANCE.md, session 17, the
engine's longest-first order), Qwen3-0.6B, us a layer:

    batch x mean context   1 split   2       4       8       16      by batch / by length
    16 x 3.6k              115.6     79.3    71.5    71.8    75.8    2 / 4
    40 x 3.9k              173.2     153.6   157.5   163.7   180.5   1 / 2
    8 x 8.3k               212.4     119.5   83.0    83.2    77.5    4 / 16
    64 x 4.0k              245.4     254.0   254.7   267.1   301.4   1 / 1 (3.9 waves)
    2 x 8.8k               202.4     106.5   59.6    35.9    28.3    16 / 16 (16 programs)

A CUDA graph fixes the grid, so the runner captures one decode graph per count that
`decode_split_variants` lists for its batch, and replays the one for the step's lengths.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

MIN_SPLIT_LEN = 256  # positions of the longest context allowed per split, at least
MAX_SPLITS = 64
# Mean contexts from which the fill target doubles (2k) and quadruples (4 x 2k and longer),
# while the batch's own programs (num_seqs x num_kv_heads) are at least a quarter of the SMs
# and fewer than LONG_WAVES times them.
LONG_CONTEXT = 2048
LONG_WAVES = 3


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of the device (132 on an H100 SXM; 132 off-GPU, for tests)."""
    if device.type != "cuda":
        return 132
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_context: int, sms: int, context: int = 0
) -> int:
    """KV splits per sequence, a power of two, at most MAX_SPLITS.

    Args:
        num_seqs: sequences in the launch (a CUDA graph's padded batch).
        num_kv_heads: KV heads of the layer (programs per sequence and split).
        max_context: the longest context the block table can describe; each split keeps at
            least MIN_SPLIT_LEN positions of it.
        sms: streaming multiprocessors of the device.
        context: the step's mean context length (0: unknown, planned as short). From
            LONG_CONTEXT on, while the batch's own programs fill a quarter of a wave to
            LONG_WAVES waves, the programs aimed at double (quadruple from 4 x LONG_CONTEXT).
    """
    programs = max(num_seqs * num_kv_heads, 1)
    factor = 1
    if sms // 4 <= programs < LONG_WAVES * sms:
        factor = 4 if context >= 4 * LONG_CONTEXT else 2 if context >= LONG_CONTEXT else 1
    wanted = -(-2 * sms * factor // programs)
    by_length = max(max_context // MIN_SPLIT_LEN, 1)
    splits = min(wanted, by_length, MAX_SPLITS)
    return 1 << (splits.bit_length() - 1)  # round down to a power of two


def decode_split_variants(
    num_seqs: int, num_kv_heads: int, max_context: int, sms: int
) -> list[int]:
    """Every count `choose_num_splits` can give this launch over the contexts it may see,
    ascending: the decode graphs to capture for a batch of `num_seqs`."""
    contexts = [c for c in (0, LONG_CONTEXT, 4 * LONG_CONTEXT) if c <= max_context]
    return sorted(
        {choose_num_splits(num_seqs, num_kv_heads, max_context, sms, c) for c in contexts}
    )


@dataclass(frozen=True)
class DecodeSplits:
    """The split rule bound to one model's KV cache and device: what the model runner and
    its CUDA-graph ladder ask of it."""

    num_kv_heads: int
    max_context: int  # the block-table width in positions (max_model_len, rounded up)
    sms: int

    def choose(self, num_seqs: int, context: int) -> int:
        """The count for a decode launch of `num_seqs` sequences of mean length `context`."""
        return choose_num_splits(num_seqs, self.num_kv_heads, self.max_context, self.sms, context)

    def variants(self, num_seqs: int) -> list[int]:
        """Every count `choose` may give for `num_seqs`, ascending."""
        return decode_split_variants(num_seqs, self.num_kv_heads, self.max_context, self.sms)
