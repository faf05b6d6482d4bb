"""LLM.beam_search on the embedded model: the same beams and scores as HF transformers' beam
search (float32, same GGUF), beams that share KV blocks copy-on-write and free them all,
results unchanged by preemption, and validated parameters."""

from __future__ import annotations

import math

import pytest
import torch

from octavo import BeamSearchParams
from octavo.tokenizer.tokenizer import apply_chat_template

QUESTIONS = [
    "What is 12 times 12?",
    "Reply with one word: yes or no. Is the sky blue?",
    "Write a haiku about the sea.",
    "What is the capital of France?",
]
# (beam_width, length_penalty, early_stopping, max_tokens): each width, penalty sign and size,
# and early_stopping value at least once.
CONFIGS = [
    (4, 1.0, True, 12),
    (4, 0.5, False, 16),
    (2, -0.5, "never", 10),
    (12, 2.0, "never", 6),  # 24 candidates a step: more top log-probs than users may ask for
]


@pytest.fixture(scope="module")
def beam_llm(llm_factory):
    return llm_factory(enable_prefix_caching=False)


@pytest.fixture(scope="module")
def prompts(beam_llm) -> list[list[int]]:
    tokenizer = beam_llm.get_tokenizer()
    return [apply_chat_template(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]


def hf_beam_search(model, prompt: list[int], width, penalty, early, max_tokens):
    """HF's beams (generated tokens, EOS kept, padding cut) and sequences_scores."""
    eos = model.generation_config.eos_token_id
    with torch.inference_mode():
        ref = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            length_penalty=penalty,
            early_stopping=early,
            max_new_tokens=max_tokens,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=eos,
        )
    beams = []
    for row in ref.sequences[:, len(prompt) :].tolist():
        # NOTE: HF pads with EOS here (pad = eos), so a beam ends at its first EOS.
        beams.append(row[: row.index(eos) + 1] if eos in row else row)
    return beams, ref.sequences_scores.tolist()


def blocks_all_free(llm) -> bool:
    """No request left behind, and every KV block free."""
    stats = llm.get_stats()
    idle = stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    return idle and stats["kv_blocks_free"] == stats["kv_blocks_total"]


@pytest.mark.slow  # HF's beam search on the CPU; the tests below hold the engine's side
@pytest.mark.parametrize(("width", "penalty", "early", "max_tokens"), CONFIGS)
def test_beams_and_scores_match_hf(beam_llm, hf_model, prompts, width, penalty, early, max_tokens):
    params = BeamSearchParams(
        beam_width=width, max_tokens=max_tokens, length_penalty=penalty, early_stopping=early
    )
    outs = beam_llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    assert len(outs) == len(prompts)
    for prompt, out in zip(prompts, outs, strict=True):
        ref_beams, ref_scores = hf_beam_search(hf_model, prompt, width, penalty, early, max_tokens)
        beams = [seq.tokens[len(prompt) :] for seq in out.sequences]
        scores = [seq.score for seq in out.sequences]
        assert all(seq.tokens[: len(prompt)] == prompt for seq in out.sequences)
        assert beams[0] == ref_beams[0]
        assert beams == ref_beams
        assert scores == sorted(scores, reverse=True)
        assert scores == pytest.approx(ref_scores, abs=1e-4, rel=1e-5)
    # The EOS path (a hypothesis scored with its EOS) is exercised by every config.
    assert any(seq.finish_reason == "stop" for out in outs for seq in out.sequences)
    assert blocks_all_free(beam_llm)


@pytest.mark.slow
def test_sequences_are_consistent(beam_llm, prompts):
    """cum_logprob is the sum of the chosen tokens' log-probs, score is HF's length-penalized
    cum_logprob, text is the generated tokens' text without EOS (or with it if asked)."""
    tokenizer = beam_llm.get_tokenizer()
    eos = set(beam_llm.engine.eos_token_ids)
    for include in (False, True):
        params = BeamSearchParams(
            beam_width=3, max_tokens=10, length_penalty=1.5, include_stop_str_in_output=include
        )
        (out,) = beam_llm.beam_search({"prompt_token_ids": prompts[1]}, params)
        assert len(out.sequences) == 3
        for seq in out.sequences:
            generated = seq.tokens[len(prompts[1]) :]
            assert len(seq.logprobs) == len(generated)
            chosen = [step[token].logprob for token, step in zip(generated, seq.logprobs)]
            assert seq.cum_logprob == pytest.approx(math.fsum(chosen), abs=1e-6)
            assert seq.score == pytest.approx(seq.cum_logprob / len(generated) ** 1.5)
            ends_with_eos = generated[-1] in eos
            assert seq.finish_reason == ("stop" if ends_with_eos else "length")
            text = tokenizer.decode(generated[:-1] if ends_with_eos else generated)
            if include and ends_with_eos:
                text += tokenizer.decode(generated[-1:])
            assert seq.text == text
    assert any(seq.finish_reason == "stop" for seq in out.sequences)


def test_beams_share_blocks_and_free_them_all(beam_llm, prompts):
    engine = beam_llm.engine
    assert blocks_all_free(beam_llm)
    # NOTE: the peak is a high-water mark since the engine started; it is idle now (no block
    # in use), so 0 is its true usage and the next reading is this search's peak.
    engine.kv.sharing.peak_blocks_used = 0
    copies_before = beam_llm.get_stats()["num_cow_copies"]
    width, max_tokens, prompt = 4, 16, prompts[0]
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True)
    (out,) = beam_llm.beam_search({"prompt_token_ids": prompt}, params)
    stats = beam_llm.get_stats()
    assert len(out.sequences) == width
    assert all(len(seq.tokens) == len(prompt) + max_tokens for seq in out.sequences)
    bs = engine.cache_config.block_size
    # A beam's KV holds its prompt and all but its last token.
    per_beam = -(-(len(prompt) + max_tokens - 1) // bs)
    shared_prompt_blocks = len(prompt) // bs
    assert shared_prompt_blocks >= 2 and len(prompt) % bs
    assert stats["kv_blocks_peak_used"] < width * per_beam
    assert stats["kv_blocks_peak_used"] <= shared_prompt_blocks + width * (
        per_beam - shared_prompt_blocks
    )
    assert stats["num_cow_copies"] > copies_before
    assert blocks_all_free(beam_llm)
    assert stats["kv_blocks_saved_by_sharing"] == 0


@pytest.mark.slow  # two searches of four prompts, one of them preempted
def test_preemption_does_not_change_the_beams(llm_factory, beam_llm, prompts):
    """A 14-block cache cannot hold 4 prompts x 4 beams: beams are preempted and parked,
    then recomputed; the beams and scores stay those of a roomy cache."""
    small = llm_factory(num_kv_blocks=14, enable_prefix_caching=False)
    params = BeamSearchParams(beam_width=4, max_tokens=8)
    batch = [{"prompt_token_ids": p} for p in prompts]
    preemptions = small.get_stats()["num_preemptions"]
    outs = small.beam_search(batch, params)
    assert small.get_stats()["num_preemptions"] > preemptions
    refs = beam_llm.beam_search(batch, params)
    for out, ref in zip(outs, refs, strict=True):
        assert [s.tokens for s in out.sequences] == [s.tokens for s in ref.sequences]
        assert [s.score for s in out.sequences] == pytest.approx(
            [s.score for s in ref.sequences], abs=1e-4
        )
    assert blocks_all_free(small)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("beam_width", 0),
        ("beam_width", 129),
        ("beam_width", 2.0),
        ("max_tokens", 0),
        ("ignore_eos", 1),
        ("temperature", -1.0),
        ("length_penalty", float("nan")),
        ("include_stop_str_in_output", "yes"),
        ("early_stopping", "always"),
    ],
)
def test_bad_params_raise_naming_the_field(field, value):
    kwargs = {"beam_width": 2, "max_tokens": 4, field: value}
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**kwargs)


def test_bad_prompt_raises_and_leaves_the_engine_idle(beam_llm, prompts):
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    bad = [{"prompt_token_ids": prompts[0]}, {"prompt_token_ids": [10**9]}]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        beam_llm.beam_search(bad, params)
    with pytest.raises(ValueError, match="params"):
        beam_llm.beam_search(bad[:1], {"beam_width": 2})
    assert blocks_all_free(beam_llm)
    assert not beam_llm.engine.has_unfinished_requests()
    # Text prompts work too, and a single one gives a list of one output.
    (out,) = beam_llm.beam_search("Hello", params)
    assert len(out.sequences) == 2
