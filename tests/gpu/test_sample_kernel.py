"""The fused sampling kernel (`race_sample`): greedy rows are argmax, random rows follow
softmax(logits / T), a row's token depends only on its seed, and masked tokens never win.
With OCTAVO_TRITON_INTERPRET=1 a small subset runs on the CPU through Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("OCTAVO_TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA (or OCTAVO_TRITON_INTERPRET=1)", allow_module_level=True)

from octavo.kernels.sample import CHUNK, race_sample

pytestmark = pytest.mark.gpu
DEVICE = "cpu" if INTERPRET else "cuda"


def seeds_for(n: int, start: int = 0) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int64, device=DEVICE) * 7919 + 12345


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [10, CHUNK + 3] + ([151936] if not INTERPRET else []))
def test_zero_temperature_is_argmax_first_index_on_ties(dtype, vocab):
    torch.manual_seed(vocab)
    logits = torch.randn(6, vocab, device=DEVICE).to(dtype)
    logits[0, :] = 1.0  # all tied: the first index
    logits[1, vocab - 1] = 100.0  # the last index, in the last chunk
    got = race_sample(logits, torch.zeros(6, device=DEVICE), seeds_for(6))
    assert got.tolist() == [0] + logits[1:].float().argmax(-1).tolist()


def test_random_rows_follow_the_softmax():
    torch.manual_seed(0)
    vocab, rows, temperature = 6, 4000 if INTERPRET else 200_000, 0.7
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf")])
    logits = base.repeat(rows, 1).to(DEVICE)
    got = race_sample(logits, torch.full((rows,), temperature, device=DEVICE), seeds_for(rows))
    freq = torch.bincount(got.cpu(), minlength=vocab).double() / rows
    expected = (base / temperature).softmax(-1).double()
    assert freq[-1] == 0  # a masked token never wins
    # Binomial standard error per token; 5 sigma.
    sigma = (expected * (1 - expected) / rows).sqrt()
    assert ((freq - expected).abs() <= 5 * sigma + 1e-12).all(), (freq, expected)


def test_entries_in_every_quarter_of_a_philox_draw_follow_the_softmax():
    """The kernel draws four uniforms per Philox call, for entries a quarter-window apart
    (window 1024, quarter 256): entries in each quarter, in a second window and in a second
    chunk must still be independent draws."""
    torch.manual_seed(2)
    positions = [3, 259, 515, 771, 1030] + ([] if INTERPRET else [CHUNK + 5])
    vocab = positions[-1] + 1
    rows, temperature = (2000 if INTERPRET else 200_000), 1.0
    base = torch.full((vocab,), float("-inf"))
    base[positions] = torch.linspace(0.5, -0.5, len(positions))
    logits = base.repeat(rows, 1).to(DEVICE)
    got = race_sample(logits, torch.full((rows,), temperature, device=DEVICE), seeds_for(rows))
    freq = torch.bincount(got.cpu(), minlength=vocab)[positions].double() / rows
    expected = base[positions].softmax(-1).double()
    sigma = (expected * (1 - expected) / rows).sqrt()
    assert ((freq - expected).abs() <= 5 * sigma).all(), (freq, expected)


def test_a_rows_token_depends_only_on_its_seed():
    torch.manual_seed(1)
    vocab = 3000
    logits = torch.randn(8, vocab, device=DEVICE)
    temperature = torch.full((8,), 1.0, device=DEVICE)
    seeds = seeds_for(8)
    first = race_sample(logits, temperature, seeds)
    again = race_sample(logits, temperature, seeds)
    assert first.tolist() == again.tolist()
    # Row 3 alone, in another batch position: the same token.
    alone = race_sample(logits[3:4], temperature[:1], seeds[3:4])
    assert alone.item() == first[3].item()
    others = race_sample(logits, temperature, seeds_for(8, start=100))
    assert others.tolist() != first.tolist()
