"""Packed token bitmasks, as structured outputs' grammars give them: token t allowed when bit
t % 32 of int32 word t // 32 is set."""

from __future__ import annotations

import torch


def bitmask_width(vocab_size: int) -> int:
    """int32 words of a grammar's bitmask over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def outside_of_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 bitmasks -> [R, vocab_size] bool, True for a token the grammar bans.
    Unpacked a byte at a time (token t is bit t % 8 of little-endian byte t // 8), so the
    temporaries take a byte per token."""
    octets = bitmask.contiguous().view(torch.uint8)  # [R, 4W]
    bits = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    allowed = (octets.unsqueeze(-1) >> bits) & 1  # [R, 4W, 8]
    return (allowed == 0).flatten(1)[:, :vocab_size]
