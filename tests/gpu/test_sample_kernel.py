"""The Triton sampler (`sample_tokens`): greedy rows are argmax, random rows follow
softmax(logits / T) wherever the mass sits (any chunk, any block of a chunk), a row's token
depends only on its seed, and masked tokens never win.
With OCTAVO_TRITON_INTERPRET=1 a small subset runs on the CPU through Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("OCTAVO_TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA (or OCTAVO_TRITON_INTERPRET=1)", allow_module_level=True)

from octavo.kernels.sample import BLOCK, CHUNK, sample_tokens

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
    got = sample_tokens(logits, torch.zeros(6, device=DEVICE), seeds_for(6))
    assert got.tolist() == [0] + logits[1:].float().argmax(-1).tolist()


def test_random_rows_follow_the_softmax():
    torch.manual_seed(0)
    vocab, rows, temperature = 6, 4000 if INTERPRET else 200_000, 0.7
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf")])
    logits = base.repeat(rows, 1).to(DEVICE)
    got = sample_tokens(logits, torch.full((rows,), temperature, device=DEVICE), seeds_for(rows))
    freq = torch.bincount(got.cpu(), minlength=vocab).double() / rows
    expected = (base / temperature).softmax(-1).double()
    assert freq[-1] == 0  # a masked token never wins
    # Binomial standard error per token; 5 sigma.
    sigma = (expected * (1 - expected) / rows).sqrt()
    assert ((freq - expected).abs() <= 5 * sigma + 1e-12).all(), (freq, expected)


def test_mass_in_several_chunks_and_blocks_follows_the_softmax():
    """Pass 2 picks a chunk by its share of the mass, then scans it block by block: tokens at
    the edges of blocks and chunks, and in a later chunk than the row's max, keep their odds."""
    torch.manual_seed(2)
    positions = [3, BLOCK - 1, BLOCK, 2 * BLOCK + 7]
    if not INTERPRET:
        positions += [CHUNK - 1, CHUNK, 2 * CHUNK + BLOCK + 5]
    vocab = positions[-1] + 2
    rows, temperature = (2000 if INTERPRET else 200_000), 0.8
    base = torch.full((vocab,), float("-inf"))
    base[positions] = torch.linspace(-0.4, 0.6, len(positions))  # the max in the last chunk
    logits = base.repeat(rows, 1).to(DEVICE)
    got = sample_tokens(logits, torch.full((rows,), temperature, device=DEVICE), seeds_for(rows))
    counts = torch.bincount(got.cpu(), minlength=vocab)
    assert counts.sum() == counts[positions].sum()  # nothing outside the allowed tokens
    freq = counts[positions].double() / rows
    expected = (base[positions] / temperature).softmax(-1).double()
    sigma = (expected * (1 - expected) / rows).sqrt()
    assert ((freq - expected).abs() <= 5 * sigma).all(), (freq, expected)


def test_a_rows_token_depends_only_on_its_seed():
    torch.manual_seed(1)
    vocab = 3000
    logits = torch.randn(8, vocab, device=DEVICE)
    temperature = torch.full((8,), 1.0, device=DEVICE)
    seeds = seeds_for(8)
    first = sample_tokens(logits, temperature, seeds)
    again = sample_tokens(logits, temperature, seeds)
    assert first.tolist() == again.tolist()
    # Row 3 alone, in another batch position: the same token.
    alone = sample_tokens(logits[3:4], temperature[:1], seeds[3:4])
    assert alone.item() == first[3].item()
    others = sample_tokens(logits, temperature, seeds_for(8, start=100))
    assert others.tolist() != first.tolist()


@pytest.mark.skipif(INTERPRET, reason="the Sampler's CUDA path needs a GPU")
def test_sampler_on_cuda_mixes_greedy_seeded_and_filtered_rows():
    """`Sampler` on CUDA: greedy rows are the argmax, top-k rows stay in their top k, and a
    seeded row's tokens do not depend on the rows around it."""
    from octavo.runner.sampler import Sampler
    from octavo.runner.sampling_metadata import SamplingMetadata
    from octavo.sampling_params import SamplingParams as SP

    vocab, cuda = 3000, torch.device("cuda")

    def run(params, logits, num_outputs):
        md = SamplingMetadata.build(
            params, [[] for _ in params], [[1] * num_outputs for _ in params], vocab, cuda
        )
        return Sampler(seed=5)(logits, md).sampled_token_ids.tolist()

    torch.manual_seed(3)
    params = [SP(temperature=0), SP(seed=42), SP(top_k=5), SP(), SP(temperature=0.5, seed=7)]
    seeded_alone, seeded_in_batch = [], []
    for step in range(8):
        logits = torch.randn(len(params), vocab, device=cuda).to(torch.bfloat16)
        got = run(params, logits, step)
        assert got[0] == logits[0].float().argmax().item()
        assert got[2] in logits[2].float().topk(5).indices.tolist()
        seeded_in_batch.append(got[1])
        seeded_alone.append(run(params[1:2], logits[1:2], step)[0])
    assert seeded_in_batch == seeded_alone
    assert len(set(seeded_alone)) > 3


@pytest.mark.skipif(INTERPRET, reason="the Sampler's CUDA path needs a GPU")
def test_sampler_on_cuda_applies_logit_bias_and_allowed_token_ids():
    """On CUDA, as on the CPU: logit_bias is added before the choice, and a row with
    allowed_token_ids never leaves them, greedy or random."""
    from octavo.runner.sampler import Sampler
    from octavo.runner.sampling_metadata import SamplingMetadata
    from octavo.sampling_params import SamplingParams as SP

    vocab, cuda = 3000, torch.device("cuda")
    torch.manual_seed(4)
    logits = torch.randn(4, vocab, device=cuda).to(torch.bfloat16)
    allowed = [7, 700, 2999]
    params = [
        SP(temperature=0, logit_bias={123: 100.0}),
        SP(temperature=0, allowed_token_ids=allowed),
        SP(seed=1, allowed_token_ids=allowed, logit_bias={7: 2.0}),
        SP(temperature=0),
    ]
    seen = set()
    for step in range(50):
        md = SamplingMetadata.build(
            params, [[] for _ in params], [[1] * step for _ in params], vocab, cuda
        )
        got = Sampler(seed=5)(logits, md).sampled_token_ids.tolist()
        ref = logits.float()
        assert got[0] == 123
        assert got[1] == allowed[ref[1, allowed].argmax().item()]
        assert got[3] == ref[3].argmax().item()
        seen.add(got[2])
    assert seen <= set(allowed) and len(seen) > 1
