"""How many parts decode attention cuts each sequence's context into (split-K, see
decode_attention.py), chosen on the host without Triton, so the CUDA-graph ladder can plan
with it on any machine.

The count fills the GPU about twice over with programs (num_seqs x num_kv_heads x splits),
and more when the step's contexts are long while the batch alone fills less than three
waves of SMs: a long program then runs on after the others, and finer splits even the SMs'
work out. Measured on an H200 (docs/PERFORMANCE.md, session 17), Qwen3-0.6B, us a layer:

    batch x mean context   1 split   2       4       8       16      fill only / with length
    16 x 4k                114.7     79.4    72.5    72.3    76.0    2 / 4
    40 x 4k                173.1     155.9   159.9   166.1   182.4   1 / 2
    8 x 8k                 214.2     118.3   83.1    84.4    78.2    4 / 16
    64 x 4k                249.0     258.2   259.3   274.7   306.2   1 / 1

A CUDA graph fixes the grid, so the runner captures one decode graph per count that
`decode_split_variants` lists for its batch, and replays the one for the step's lengths.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

MIN_SPLIT_LEN = 256  # positions of the longest context allowed per split, at least
MAX_SPLITS = 64
# Mean contexts from which the fill target doubles (4k) and quadruples (8k and longer).
LONG_CONTEXT = 4096
LONG_WAVES = 3  # the length factor applies while num_seqs x num_kv_heads < 3 x SMs


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
            LONG_CONTEXT on, and while the batch's own programs fill fewer than LONG_WAVES
            waves, the programs aimed at double (quadruple from 2 x LONG_CONTEXT).
    """
    programs = max(num_seqs * num_kv_heads, 1)
    factor = 1
    if programs < LONG_WAVES * sms:
        factor = 4 if context >= 2 * LONG_CONTEXT else 2 if context >= LONG_CONTEXT else 1
    wanted = -(-2 * sms * factor // programs)
    by_length = max(max_context // MIN_SPLIT_LEN, 1)
    splits = min(wanted, by_length, MAX_SPLITS)
    return 1 << (splits.bit_length() - 1)  # round down to a power of two


def decode_split_variants(
    num_seqs: int, num_kv_heads: int, max_context: int, sms: int
) -> list[int]:
    """Every count `choose_num_splits` can give this launch over the contexts it may see,
    ascending: the decode graphs to capture for a batch of `num_seqs`."""
    contexts = [c for c in (0, LONG_CONTEXT, 2 * LONG_CONTEXT) if c <= max_context]
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
