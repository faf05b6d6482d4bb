"""The structured-output ban kernel (`ban_outside_bitmask_`) against the torch reference
(`outside_of_bitmask`, then masked_fill) on fresh random inputs: vocabularies that end inside
a word and inside a program's block, rows in any order, all-allowed and all-banned masks, and
float32 and bfloat16 logits. With OCTAVO_TRITON_INTERPRET=1 a small subset runs on the CPU
through Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("OCTAVO_TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA (or OCTAVO_TRITON_INTERPRET=1)", allow_module_level=True)

from octavo.kernels.token_bitmask import BLOCK, ban_outside_bitmask_
from octavo.runner.penalties import bitmask_width, outside_of_bitmask

pytestmark = pytest.mark.gpu
DEVICE = "cpu" if INTERPRET else "cuda"
VOCABS = [1, 31, 33, BLOCK + 17] + ([151936, 49152] if not INTERPRET else [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("seed", range(2 if INTERPRET else 4))
def test_bans_match_the_torch_reference(vocab, dtype, seed):
    gen = torch.Generator().manual_seed(seed * 1000 + vocab)
    batch = int(torch.randint(1, 9, (), generator=gen))
    logits = torch.randn(batch, vocab, generator=gen).to(dtype)
    num_rows = int(torch.randint(1, batch + 1, (), generator=gen))
    rows = torch.randperm(batch, generator=gen)[:num_rows]  # any order, each row once
    words = torch.randint(-(2**31), 2**31, (num_rows, bitmask_width(vocab)), generator=gen)
    bitmask = words.to(torch.int32)
    bitmask[0] = -1  # every token allowed
    if num_rows > 1:
        bitmask[1] = 0  # none allowed
    expected = logits.clone()
    banned = outside_of_bitmask(bitmask, vocab)
    expected[rows] = expected[rows].masked_fill(banned, float("-inf"))
    got = logits.to(DEVICE)
    ban_outside_bitmask_(got, rows.to(DEVICE), bitmask.to(DEVICE))
    assert torch.equal(got.cpu(), expected)
    # Rows of a wider tensor (row stride > V): the columns past V stay as they were.
    extra = torch.randn(batch, 40, generator=gen).to(dtype)
    wide = torch.cat([logits, extra], 1).to(DEVICE)
    ban_outside_bitmask_(wide[:, :vocab], rows.to(DEVICE), bitmask.to(DEVICE))
    assert torch.equal(wide[:, :vocab].cpu(), expected)
    assert torch.equal(wide[:, vocab:].cpu(), extra)


def test_a_bad_bitmask_is_refused():
    logits = torch.zeros(2, 40, device=DEVICE)
    rows = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ValueError, match="one int32 row"):
        ban_outside_bitmask_(logits, rows, torch.zeros(2, 1, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="one int32 row"):
        ban_outside_bitmask_(logits, rows, torch.zeros(2, 2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="int64 rows"):
        ban_outside_bitmask_(
            logits, rows.int(), torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
        )
