"""Sampler: greedy, filters, temperature, penalties, min_tokens bans, seeds and logprobs, each
checked against an independent numpy / plain-Python reference."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from octavo.engine.structured_output import GrammarBitmaskBuilder
from octavo.runner.penalties import apply_penalties, bitmask_width, outside_of_bitmask
from octavo.runner.sampler import Sampler, apply_filters, apply_top_k_top_p
from octavo.runner.sampling_metadata import GrammarMasks, SamplingMetadata, seeded_rows
from octavo.sampling_params import SamplingParams as SP

CPU = torch.device("cpu")


def build(params, prompts=None, outputs=None, vocab=50, eos=()):
    prompts = prompts or [[] for _ in params]
    outputs = outputs or [[] for _ in params]
    for p in params:
        p.set_eos_token_ids(tuple(eos))  # as the engine does
    return SamplingMetadata.build(params, prompts, outputs, vocab, CPU)


def randn(rows, vocab, seed, scale=2.0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def allowed(row, temperature=1.0, top_k=None, top_p=1.0, min_p=0.0, margin=None):
    """Reference support: min-p, then the top_k largest, then the smallest most-likely prefix
    of the renormalized rest reaching top_p. With `margin`, also the distance of the nearest
    threshold, so callers can skip cases that float32 rounding could flip."""
    x = np.asarray(row, dtype=np.float64) / temperature
    p = softmax(x)
    kept = [i for i in range(len(x)) if p[i] >= min_p * p.max()]
    gaps = [abs(p[i] / p.max() - min_p) for i in range(len(x))] if min_p > 0 else [1.0]
    kept = sorted(kept, key=lambda i: -x[i])[:top_k]
    if top_p < 1:
        q = p[kept] / p[kept].sum()
        cumulative = np.cumsum(q)
        gaps.extend(abs(cumulative - top_p))
        kept = kept[: int((cumulative < top_p).sum()) + 1]
    return (set(kept), min(gaps)) if margin else set(kept)


def finite_set(row):
    return set(torch.isfinite(row).nonzero().flatten().tolist())


def chi_square_ok(tokens, probs, n):
    """Chi-square over bins of expected count >= 5 (the rest merged), with a loose bound."""
    counts = np.bincount(np.asarray(tokens), minlength=len(probs))
    expected = n * np.asarray(probs)
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    chi2 = (((obs - exp) ** 2)[keep] / exp[keep]).sum()
    df = max(int(keep.sum()) - 1, 1)
    return chi2 < df + 6 * np.sqrt(2 * df) + 10, chi2


def test_greedy_rows_take_the_argmax_in_all_greedy_and_mixed_batches():
    logits = randn(4, 80, seed=0)
    before = logits.clone()
    md = build([SP(temperature=0)] * 4, vocab=80)
    assert md.all_greedy and md.temperature is None
    assert Sampler()(logits, md).sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    mixed = [SP(temperature=0), SP(top_k=3), SP(temperature=0, top_k=2), SP(min_p=0.5)]
    out = Sampler()(logits, build(mixed, vocab=80)).sampled_token_ids
    assert out[[0, 2]].tolist() == logits[[0, 2]].argmax(-1).tolist()
    assert torch.equal(logits, before)  # the input is not modified
    bf16 = logits.to(torch.bfloat16)
    assert Sampler()(bf16, md).sampled_token_ids.tolist() == bf16.float().argmax(-1).tolist()


def test_apply_filters_keeps_exactly_the_reference_support_per_row():
    settings_per_row = [
        {"temperature": 0},
        {"top_k": 5},
        {"top_p": 0.6},
        {"min_p": 0.2},
        {"top_k": 20, "top_p": 0.5, "temperature": 0.7},
        {"min_p": 0.05, "top_k": 12, "top_p": 0.9, "temperature": 1.5},
        {"top_k": 1000},  # larger than the vocab: off
        {"temperature": 2.0},
    ]
    params = [SP(**s) for s in settings_per_row]
    for seed, vocab in [(1, 50), (2, 131), (3, 200)]:
        logits = randn(len(params), vocab, seed=seed)
        filtered = apply_filters(logits, build(params, vocab=vocab))
        for row, p in enumerate(params):
            t = p.temperature or 1.0  # greedy rows are left unfiltered
            ref = allowed(logits[row].numpy(), t, p.top_k, p.top_p, p.min_p)
            assert finite_set(filtered[row]) == ref, (seed, p)
            kept = sorted(ref)
            torch.testing.assert_close(filtered[row, kept], logits[row, kept] / t)


def splitmix64(x: int) -> int:
    mask = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


def noise_seed(seed: int, num_output_tokens: int) -> int:
    """The reference: a seeded row's noise seed as the sampler defined it before numpy."""
    return splitmix64(splitmix64(seed & ((1 << 64) - 1)) ^ num_output_tokens) >> 1


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**20),
    vocab=st.integers(2, 120),
    rows=st.lists(st.tuples(st.integers(0, 130), st.floats(0.01, 1.0)), min_size=1, max_size=4),
    use_k=st.booleans(),
    use_p=st.booleans(),
    head_size=st.integers(1, 130),
)
def test_top_k_top_p_matches_reference_for_any_head_size(
    seed, vocab, rows, use_k, use_p, head_size
):
    logits = randn(len(rows), vocab, seed=seed, scale=3.0)
    ks = [min(max(k, 1), vocab) for k, _ in rows]  # k = vocab means off
    ps = [p if p < 0.999 else 1.0 for _, p in rows]
    refs = []
    for r in range(len(rows)):
        k, p = (ks[r] if use_k else None), (ps[r] if use_p else 1.0)
        ref, gap = allowed(logits[r].numpy(), top_k=k, top_p=p, margin=True)
        assume(gap > 1e-4)
        refs.append(ref)
    top_k = torch.tensor(ks) if use_k else None
    top_p = torch.tensor(ps) if use_p else None
    out = apply_top_k_top_p(logits, top_k, top_p, head_size=head_size)
    for r, ref in enumerate(refs):
        assert finite_set(out[r]) == ref, r


@pytest.mark.parametrize(
    "params",
    [SP(top_k=6), SP(top_p=0.7), SP(min_p=0.1), SP(top_k=10, top_p=0.8, temperature=0.8)],
    ids=["top_k", "top_p", "min_p", "top_k+top_p+temperature"],
)
def test_sampled_tokens_stay_in_support_with_renormalized_frequencies(params):
    n, vocab = 3000, 60
    row = randn(1, vocab, seed=4)[0]
    tokens = Sampler(seed=5)(row.expand(n, vocab), build([params] * n, vocab=vocab))
    tokens = tokens.sampled_token_ids.tolist()
    ref = allowed(row.numpy(), params.temperature, params.top_k, params.top_p, params.min_p)
    assert set(tokens) <= ref
    probs = softmax(row.double().numpy() / params.temperature)
    probs = np.where(np.isin(np.arange(vocab), list(ref)), probs, 0)
    ok, chi2 = chi_square_ok(tokens, probs / probs.sum(), n)
    assert ok, chi2


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_frequencies_follow_softmax_of_logits_over_temperature(temperature):
    n, vocab = 4000, 40
    row = randn(1, vocab, seed=6, scale=1.5)[0]
    md = build([SP(temperature=temperature)] * n, vocab=vocab)
    tokens = Sampler(seed=7)(row.expand(n, vocab), md).sampled_token_ids.tolist()
    x = row.double().numpy()
    ok, chi2 = chi_square_ok(tokens, softmax(x / temperature), n)
    assert ok, chi2
    wrong, chi2_t1 = chi_square_ok(tokens, softmax(x), n)  # the test has power
    assert not wrong, chi2_t1


def test_seeded_rows_sample_the_reference_distribution():
    n, vocab = 2000, 30
    row = randn(1, vocab, seed=8, scale=1.0)[0]
    md = build([SP(seed=s, temperature=0.9) for s in range(n)], vocab=vocab)
    tokens = Sampler()(row.expand(n, vocab), md).sampled_token_ids.tolist()
    ok, chi2 = chi_square_ok(tokens, softmax(row.double().numpy() / 0.9), n)
    assert ok, chi2


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.one_of(st.none(), st.integers(-(2**70), 2**70)),  # seed; None: unseeded
            st.booleans(),  # greedy
            st.integers(0, 10**6),  # number of outputs so far
        ),
        max_size=20,
    )
)
def test_seeded_rows_hash_each_row_as_the_scalar_hash_does(rows):
    """The per-step seeds of seeded random rows, hashed in one numpy pass, equal the hash
    in Python's integers: the noise of a seed stays what it was."""
    params = [SP(seed=seed, temperature=0 if greedy else 1.0) for seed, greedy, _ in rows]
    counts = [count for _, _, count in rows]
    expected = tuple(
        (row, noise_seed(seed, count))
        for row, (seed, greedy, count) in enumerate(rows)
        if seed is not None and not greedy
    )
    assert seeded_rows(params, counts) == expected


def reference_penalties(row, prompt, output, rep, freq, pres):
    out = [float(v) for v in row]
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t, count in Counter(output).items():
        out[t] -= freq * count + pres
    return out


def test_penalties_match_the_direct_formula_per_row():
    vocab = 40
    rows = [  # (repetition, frequency, presence, prompt, output)
        (1.3, 0.0, 0.0, [1, 2, 2, 9], [3, 1, 3]),
        (0.7, 0.0, 0.0, [4, 5], [6]),
        (1.0, 0.5, 0.0, [7, 8], [7, 10, 10, 10]),
        (1.0, 0.0, -0.8, [11], [12, 12, 13]),
        (1.5, 1.2, 0.4, [0, 14, 15], [15, 15, 16, 0, 39]),
        (1.0, 0.0, 0.0, [1, 2, 3], [4, 5, 5]),  # no penalties: unchanged
    ]
    params = [
        SP(repetition_penalty=r, frequency_penalty=f, presence_penalty=p, temperature=0)
        for r, f, p, _, _ in rows
    ]
    prompts, outputs = [r[3] for r in rows], [r[4] for r in rows]
    logits = randn(len(rows), vocab, seed=9)
    md = build(params, prompts, outputs, vocab=vocab)
    got = apply_penalties(logits, md.penalties)
    for i, (rep, freq, pres, prompt, output) in enumerate(rows):
        ref = reference_penalties(logits[i].tolist(), prompt, output, rep, freq, pres)
        torch.testing.assert_close(got[i], torch.tensor(ref), msg=f"row {i}")
    boosted = logits.clone()
    boosted[torch.arange(len(rows)), [r[4][0] for r in rows]] += 3.0  # an output token on top
    tokens = Sampler()(boosted, md).sampled_token_ids.tolist()
    for i, (rep, freq, pres, prompt, output) in enumerate(rows):
        ref = reference_penalties(boosted[i].tolist(), prompt, output, rep, freq, pres)
        assert tokens[i] == int(np.argmax(ref)), i


def test_repetition_penalty_at_float32_limits_keeps_logits_finite():
    # 1.2e-38 divides a positive logit past float32's range, 3.4e38 multiplies a negative one.
    vocab = 8
    params = [SP(repetition_penalty=r, temperature=0) for r in (1.2e-38, 3.4e38)]
    logits = torch.tensor([[8.0, -1.0, 0.5, 0.0, 1.0, -3.0, 0.25, 4.0]] * 2)
    md = build(params, [[0, 1, 3], [1, 3, 5, 7]], [[5], [0]], vocab=vocab)
    got = apply_penalties(logits, md.penalties)
    assert torch.isfinite(got).all(), got
    assert got[0, 0] == torch.finfo(torch.float32).max  # 8 / 1.2e-38, held at the largest
    assert got[1, 5] == -torch.finfo(torch.float32).max and got[1, 3] == 0  # -3 * 3.4e38
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [0, 4]


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    vocab, eos = 20, [3, 7, 25]  # 25 is outside the vocab and ignored
    logits = randn(6, vocab, seed=10, scale=0.5)
    logits[:, [3, 5, 7]] = torch.tensor([12.0, 11.0, 10.0])
    cases = [  # (params, number of outputs, banned ids)
        (SP(min_tokens=3, stop_token_ids=[5]), 2, {3, 5, 7}),
        (SP(min_tokens=3, stop_token_ids=[5]), 3, set()),
        (SP(min_tokens=3, stop_token_ids=[5], ignore_eos=True), 0, {5}),
        (SP(min_tokens=2), 1, {3, 7}),
        (SP(min_tokens=0, stop_token_ids=[5]), 0, set()),
        (SP(min_tokens=1, stop_token_ids=[25, 19]), 0, {3, 7, 19}),
    ]
    params = [SP(**{**vars(p), "temperature": 0}) for p, _, _ in cases]
    outputs = [[0] * length for _, length, _ in cases]
    md = build(params, outputs=outputs, vocab=vocab, eos=eos)
    greedy = Sampler()(logits, md).sampled_token_ids.tolist()
    for row, (_, _, banned) in enumerate(cases):
        ref = [v if i not in banned else -np.inf for i, v in enumerate(logits[row].tolist())]
        assert greedy[row] == int(np.argmax(ref)), row
    n = 500  # random rows: a banned token never comes out, however likely
    md = build([cases[0][0]] * n, outputs=[[0, 0]] * n, vocab=vocab, eos=eos)
    tokens = set(Sampler()(logits[0].expand(n, vocab), md).sampled_token_ids.tolist())
    assert not tokens & {3, 5, 7} and len(tokens) > 1


def test_bad_words_ban_a_words_last_token_where_the_output_ends_with_the_rest():
    """vLLM's rule: a one-token bad word is always banned; a longer one only where the
    row's output (not its prompt) ends with all but its last token."""
    vocab = 20
    logits = randn(5, vocab, seed=11, scale=0.5)
    logits[:, [4, 6, 9]] = torch.tensor([12.0, 11.0, 10.0])
    logits[[1, 2], 6] = logits[4, 9] = 13.0  # each row's likeliest token is the one at stake
    codes = {"a": [4], " a": [4], "b c": [5, 6], " b c": [5, 6], "d e f": [7, 8, 9],
             " d e f": [7, 8, 9]}  # fmt: skip
    cases = [  # (bad words, prompt, output, banned ids)
        (["a"], [], [], {4}),
        (["b c"], [], [1, 5], {6}),
        (["b c"], [5], [], set()),  # the prompt's end does not count
        (["d e f", "a"], [], [7, 8], {9, 4}),
        (["d e f"], [], [8, 7], set()),
    ]
    params = []
    for words, _, _, _ in cases:
        p = SP(temperature=0, bad_words=words)
        p.encode_bad_words(codes.__getitem__, vocab)
        params.append(p)
    md = build(params, [c[1] for c in cases], [c[2] for c in cases], vocab=vocab)
    greedy = Sampler()(logits, md).sampled_token_ids.tolist()
    for row, (_, _, _, banned) in enumerate(cases):
        ref = [v if i not in banned else -np.inf for i, v in enumerate(logits[row].tolist())]
        assert greedy[row] == int(np.argmax(ref)), row
    assert greedy[1] != 6 and (greedy[2], greedy[4]) == (6, 9)  # no match, no ban


class FixedGrammar:
    """A stand-in for a structured output's Grammar that allows a fixed set of tokens."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed

    def fill_bitmask(self, row: torch.Tensor) -> None:
        words = [0] * row.numel()
        for t in self.allowed:
            words[t // 32] |= 1 << (t % 32)
        row.copy_(torch.tensor(np.array(words, dtype=np.uint32).view(np.int32)))


def with_grammars(md: SamplingMetadata, grammars) -> SamplingMetadata:
    """The metadata with the grammars' bans added, as the engine builds the step's bitmask
    and the runner adds it: row i belongs to request f"r{i}" (no grammar where None)."""
    rows = [(f"r{i}", None, 0) for i in range(len(grammars))]
    constrained = [(f"r{i}", g) for i, g in enumerate(grammars) if g is not None]
    bitmask = GrammarBitmaskBuilder(md.vocab_size, pin_memory=False).build(
        [r for r, _ in constrained], [g for _, g in constrained]
    )
    return replace(md, grammar_bans=GrammarMasks(CPU).bans(rows, bitmask))


@given(st.integers(1, 100), st.integers(0, 2**32 - 1))
def test_outside_of_bitmask_unpacks_one_bit_per_token(vocab, seed):
    words = np.random.default_rng(seed).integers(0, 2**32, (3, bitmask_width(vocab)))
    bitmask = torch.tensor(words.astype(np.uint32).view(np.int32))
    bits = np.unpackbits(words.astype("<u4").view(np.uint8), axis=1, bitorder="little")
    expected = torch.tensor(bits[:, :vocab] == 0)
    assert torch.equal(outside_of_bitmask(bitmask, vocab), expected)


def test_grammar_bans_keep_each_row_to_its_grammars_tokens(monkeypatch):
    """A row with a structured output samples only what its grammar allows (token 31 and 32
    sit on either side of a bitmask word); other rows are untouched."""

    def fill_each(grammars, bitmask):  # llguidance's parallel fill takes real matchers only
        for g, row in zip(grammars, bitmask, strict=True):
            g.fill_bitmask(row)

    monkeypatch.setattr("octavo.engine.structured_output.fill_bitmasks", fill_each)
    vocab = 70
    logits = randn(3, vocab, seed=12)
    logits[:, 5] = 20.0  # everyone's favourite, which no grammar allows
    grammars = [FixedGrammar({31, 32, 69}), None, FixedGrammar({2})]
    params = [SP(temperature=0), SP(temperature=0), SP(temperature=0)]
    md = with_grammars(build(params, vocab=vocab), grammars)
    given = logits.clone()
    greedy = Sampler()(logits, md).sampled_token_ids.tolist()
    assert greedy[0] == max((31, 32, 69), key=lambda t: logits[0, t]) and greedy[1:] == [5, 2]
    assert torch.equal(logits, given)  # the bans go on a copy (these are float32 already)
    n = 400
    md = with_grammars(build([SP(temperature=5.0)] * n, vocab=vocab), [grammars[0]] * n)
    tokens = set(Sampler()(logits[0].expand(n, vocab), md).sampled_token_ids.tolist())
    assert tokens == {31, 32, 69}
    # Other bans that leave none of the grammar's tokens give way to the grammar.
    clash = [
        SP(temperature=0, allowed_token_ids=[1, 2, 5]),
        SP(temperature=0, logit_bias={2: -1e30}),
    ]
    md = with_grammars(build(clash, vocab=vocab), [grammars[0], grammars[2]])
    assert Sampler()(logits[:2], md).sampled_token_ids.tolist() == [greedy[0], 2]
    for p in [SP(temperature=0, min_tokens=3, stop_token_ids=[2]),  # banned until 3 tokens
              SP(temperature=0, bad_words=["x"])]:  # fmt: skip
        p.encode_bad_words({"x": [2], " x": [2]}.__getitem__, vocab)
        md = with_grammars(build([p], vocab=vocab), [grammars[2]])
        assert Sampler()(logits[:1], md).sampled_token_ids.tolist() == [2], p


def test_logit_bias_and_allowed_token_ids_shape_the_logits_per_row():
    """Greedy rows take the argmax of logits + bias over the allowed tokens; random rows
    draw from softmax(logits + bias) over them; other rows and the logprobs are untouched
    (vLLM's raw logprobs)."""
    vocab = 30
    logits = randn(4, vocab, seed=12)
    cases = [
        SP(temperature=0, logit_bias={5: 100.0}),
        SP(temperature=0, logit_bias={int(logits[1].argmax()): -100.0, 2: 3.5}),
        SP(temperature=0, allowed_token_ids=[4, 9, 17], logit_bias={9: -2.0}),
        SP(temperature=0, logprobs=2),
    ]
    out = Sampler()(logits, build(cases, vocab=vocab))
    for row, p in enumerate(cases):
        ref = logits[row].double().numpy().copy()
        for t, b in (p.logit_bias or {}).items():
            ref[t] += b
        if p.allowed_token_ids:
            ref[[i for i in range(vocab) if i not in p.allowed_token_ids]] = -np.inf
        assert out.sampled_token_ids[row].item() == int(np.argmax(ref)), row
    raw = logits[3].log_softmax(-1)
    assert out.logprobs[3, 0].item() == pytest.approx(raw.max().item())

    n, row = 3000, logits[0]
    params = SP(temperature=1.0, allowed_token_ids=[1, 2, 3], logit_bias={3: 1.0, 20: 50.0})
    tokens = Sampler(seed=3)(row.expand(n, vocab), build([params] * n, vocab=vocab))
    tokens = tokens.sampled_token_ids.tolist()
    assert set(tokens) <= {1, 2, 3}
    x = row.double().numpy().copy()
    x[3] += 1.0
    probs = np.zeros(vocab)
    probs[[1, 2, 3]] = softmax(x[[1, 2, 3]])
    ok, chi2 = chi_square_ok(tokens, probs, n)
    assert ok, chi2


def test_repetition_penalty_keeps_a_banned_token_banned():
    """Its clamp to float32's range turned -inf (allowed_token_ids, a -inf bias) into a
    finite logit, so a prompt token outside allowed_token_ids could be sampled."""
    md = build([SP(temperature=0, repetition_penalty=1.2)], prompts=[[1, 2, 4]], vocab=30)
    logits = randn(1, 30, seed=14)
    logits[0, [2, 5]] = float("-inf")  # 2 is a prompt token, so it is penalized
    penalized = apply_penalties(logits, md.penalties)
    assert penalized[0, 2] == penalized[0, 5] == float("-inf")
    assert torch.isfinite(penalized[0, [0, 1, 3, 4]]).all()


def test_logit_shaping_made_once_per_params_follows_a_revalidated_change():
    """The sampler keeps a request's bias and allowed ids as tensors between steps; a field
    changed and validated again (as the engine does when it takes a request) is seen."""
    logits = randn(1, 30, seed=13)
    params = SP(temperature=0, logit_bias={5: 100.0})
    assert Sampler()(logits, build([params], vocab=30)).sampled_token_ids.item() == 5
    params.logit_bias, params.allowed_token_ids = {6: 100.0}, [6, 7]
    params.validate()
    assert Sampler()(logits, build([params], vocab=30)).sampled_token_ids.item() == 6
    params.logit_bias = None
    params.validate()
    expected = 6 if logits[0, 6] > logits[0, 7] else 7
    assert Sampler()(logits, build([params], vocab=30)).sampled_token_ids.item() == expected


def seeded_tokens(target, steps, others=(), position=0, sampler_seed=0, warmup=0):
    """Tokens of `target` at outputs 0..steps-1 in a batch with `others` around it."""
    vocab = 100
    row = randn(1, vocab, seed=11, scale=0.3)[0]  # nearly flat: tokens are all noise
    sampler = Sampler(seed=sampler_seed)
    tokens = []
    for step in range(steps):
        params = list(others)
        params.insert(position, target)
        logits = randn(len(params), vocab, seed=100 + step)
        logits[position] = row
        outputs = [[1] * (step if i == position else 3 + i) for i in range(len(params))]
        md = build(params, outputs=outputs, vocab=vocab)
        for _ in range(warmup):
            sampler(logits, md)
        tokens.append(sampler(logits, md).sampled_token_ids[position].item())
    return tokens


def test_seeded_row_ignores_batch_composition_position_and_other_rows():
    target = SP(seed=42)
    alone = seeded_tokens(target, 12)
    others = [SP(), SP(seed=43), SP(temperature=0), SP(top_k=3, seed=42), SP(top_p=0.5)]
    assert seeded_tokens(target, 12, others[:2], position=2, sampler_seed=9, warmup=2) == alone
    assert seeded_tokens(target, 12, others, position=3) == alone
    assert seeded_tokens(target, 12, others[::-1], position=5, sampler_seed=1) == alone
    assert len(set(alone)) > 3  # each output length draws new noise
    assert seeded_tokens(SP(seed=43), 12) != alone
    assert seeded_tokens(SP(seed=0), 12) != seeded_tokens(SP(seed=1), 12)


def test_unseeded_rows_depend_on_the_sampler_seed():
    assert seeded_tokens(SP(), 12, sampler_seed=0) != seeded_tokens(SP(), 12, sampler_seed=1)
    assert seeded_tokens(SP(), 12, sampler_seed=3) == seeded_tokens(SP(), 12, sampler_seed=3)


def test_logprobs_are_raw_log_softmax_with_sampled_token_first_and_ranks():
    vocab = 64
    logits = randn(5, vocab, seed=12)
    top = logits.argmax(-1).tolist()
    params = [
        SP(temperature=0, logprobs=3, min_tokens=1),  # its top token is banned: rank 2
        SP(temperature=2.0, repetition_penalty=1.8, presence_penalty=1, logprobs=5),
        SP(temperature=1.5, logprobs=0),
        SP(temperature=0),  # asked for none
        SP(temperature=0, logprobs=1, frequency_penalty=2.0),
    ]
    outputs = [[], [top[1]], [], [], [top[4]] * 3]
    md = build(params, [[top[1]]] * 5, outputs, vocab=vocab, eos=[top[0]])
    out = Sampler(seed=3)(logits, md)
    assert out.logprobs.shape == out.logprob_token_ids.shape == (5, 6)
    ref = torch.log_softmax(logits.double(), -1).numpy()
    sampled = out.sampled_token_ids.tolist()
    assert sampled[0] != top[0] and sampled[4] != top[4]
    for r, p in enumerate(params):
        if p.logprobs is None:
            continue
        order = np.argsort(-ref[r])[: p.logprobs].tolist()
        assert out.logprob_token_ids[r, : p.logprobs + 1].tolist() == [sampled[r]] + order
        expect = torch.tensor(ref[r, [sampled[r]] + order], dtype=torch.float32)
        torch.testing.assert_close(out.logprobs[r, : p.logprobs + 1], expect)
        assert out.sampled_token_ranks[r].item() == 1 + int((ref[r] > ref[r, sampled[r]]).sum())
    assert out.sampled_token_ranks[0].item() == 2
    assert Sampler()(logits, build([SP()] * 5, vocab=vocab)).logprobs is None


def test_build_refuses_lists_of_different_lengths():
    with pytest.raises(ValueError, match="differ in length"):
        SamplingMetadata.build([SP()], [[1]], [[], []], 10, CPU)


def test_the_largest_temperature_keeps_bans():
    """At MAX_TEMPERATURE sampling is uniform over the allowed tokens: a banned logit stays
    -inf (over an inf temperature it was NaN, and the bans broke)."""
    from octavo.sampling_params import MAX_TEMPERATURE

    params = [SP(temperature=MAX_TEMPERATURE, seed=s, allowed_token_ids=[3, 7]) for s in range(64)]
    tokens = Sampler()(randn(64, 50, seed=4), build(params)).sampled_token_ids.tolist()
    assert set(tokens) == {3, 7}
