"""Speculative decoding end to end: the embedded model answers with the same tokens and
log-probs with n-gram speculation as without (greedy and seeded, batched, preempted, from
the prefix cache), stops and limits land where they do without it, and on a tiny model the
tokens of unseeded sampling follow the same distribution (a chi-square test that a wrong
acceptance rule fails)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CHAT_PROMPTS
from engine_utils import prompts_of, scheduling
from scipy.stats import chi2_contingency

from octavo import LLM, SamplingParams
from octavo.tokenizer.tokenizer import apply_chat_template

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
COPYING = [
    "Repeat exactly: the cat sat on the mat, the dog sat on the log, the cow sat on the hay.",
    "Write the numbers from one to twelve as words, separated by commas.",
    "Rename x to y and show the code: def f(x):\n    return x * x + x",
    "Quote the first sentence exactly: Paris is the capital of France. It is on the Seine.",
]


def _ids(llm, texts):
    tok = llm.get_tokenizer()
    return [apply_chat_template(tok, [{"role": "user", "content": t}]) for t in texts]


def _results(outputs):
    return [
        (
            c.token_ids,
            c.text,
            c.finish_reason,
            c.stop_reason,
            None
            if c.logprobs is None
            else [sorted((t, lp.logprob) for t, lp in d.items()) for d in c.logprobs],
        )
        for o in outputs
        for c in o.outputs
    ]


@pytest.fixture(
    scope="module",
    params=["auto", pytest.param(None, marks=pytest.mark.slow)],
    ids=["gguf", "float32"],
)
def pair(request, llm_factory):
    """(engine without speculation, engine with it) on one path."""
    plain = llm_factory(quantization=request.param)
    spec = llm_factory(quantization=request.param, speculative_config=NGRAM)
    return plain, spec


def _compare(pair, prompts, params, batched=True):
    plain, spec = pair
    before = spec.get_stats()["spec_accepted_tokens"]
    if batched:
        want = plain.generate(prompts_of(prompts), params, use_tqdm=False)
        got = spec.generate(prompts_of(prompts), params, use_tqdm=False)
    else:
        want = [plain.generate(prompts_of([p]), params, use_tqdm=False)[0] for p in prompts]
        got = [spec.generate(prompts_of([p]), params, use_tqdm=False)[0] for p in prompts]
    assert _results(got) == _results(want)
    return spec.get_stats()["spec_accepted_tokens"] - before


def test_greedy_tokens_and_logprobs_are_the_same_alone_and_batched(pair):
    prompts = _ids(pair[0], COPYING + CHAT_PROMPTS[:4])
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=2)
    accepted = _compare(pair, prompts, params, batched=False)
    accepted += _compare(pair, prompts, params)
    assert accepted > 20  # the guesses were used, so the comparison means something
    stats = pair[1].get_stats()
    assert stats["spec_mean_accepted_length"] > 1.5
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_async_scheduling_speculates_between_the_steps_it_overlaps(pair):
    """With async scheduling (CUDA's default) a step that speculates first waits for the
    one in flight; the tokens stay the same, beside a structured output and penalties."""
    prompts = _ids(pair[0], COPYING)
    params = [
        SamplingParams(temperature=0, max_tokens=32),
        SamplingParams(temperature=0, max_tokens=32, repetition_penalty=1.3),
        SamplingParams(temperature=0.7, seed=5, max_tokens=32, n=2),
        SamplingParams(temperature=0, max_tokens=32, logprobs=1),
    ]
    with scheduling(pair[1], overlap=True):
        accepted = _compare(pair, prompts, params)
    assert accepted > 10


def test_seeded_sampling_penalties_and_n_are_the_same(pair):
    prompts = _ids(pair[0], COPYING)
    for params in [
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=32),
        SamplingParams(temperature=1.0, top_k=5, seed=3, max_tokens=32, n=2),
        SamplingParams(temperature=0, repetition_penalty=1.2, frequency_penalty=0.3, max_tokens=32),
        SamplingParams(temperature=0, max_tokens=24, min_tokens=20, bad_words=["cat sat"]),
    ]:
        _compare(pair, prompts, params)


def test_stops_and_max_tokens_land_where_they_do_without_speculation(pair):
    plain, _ = pair
    prompts = _ids(plain, COPYING)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    greedy = [o.outputs[0] for o in plain.generate(prompts_of(prompts), params, use_tqdm=False)]
    for max_tokens in (1, 3, 5):
        _compare(pair, prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    # Stop ids and strings met inside a verified run of guesses, and just after one: each
    # prompt stops at a token or word of its own answer.
    for index in (6, 11):
        per_prompt = [
            SamplingParams(
                temperature=0,
                max_tokens=40,
                stop_token_ids=[c.token_ids[min(index, len(c.token_ids) - 1)]],
            )
            for c in greedy
        ]
        _compare(pair, prompts, per_prompt)
    for index, include in ((4, False), (6, True)):
        per_prompt = [
            SamplingParams(
                temperature=0,
                max_tokens=40,
                stop=[(c.text.split() + ["zzz"] * 9)[index]],
                include_stop_str_in_output=include,
            )
            for c in greedy
        ]
        _compare(pair, prompts, per_prompt)


@pytest.mark.slow  # an engine of its own (14 KV blocks), 8 prompts of 40 tokens each
def test_preemption_and_prefix_hits_give_the_same_tokens(llm_factory):
    plain = llm_factory()
    tight = llm_factory(speculative_config=NGRAM, num_kv_blocks=14)
    prompts = _ids(plain, COPYING + CHAT_PROMPTS[:4])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = _results(plain.generate(prompts_of(prompts), params, use_tqdm=False))
    before = tight.get_stats()["num_preemptions"]
    assert _results(tight.generate(prompts_of(prompts), params, use_tqdm=False)) == want
    assert tight.get_stats()["num_preemptions"] > before
    hits = tight.get_stats()["prefix_cache_hits"]
    assert _results(tight.generate(prompts_of(prompts[:2]), params, use_tqdm=False)) == want[:2]
    assert tight.get_stats()["prefix_cache_hits"] > hits


def test_structured_outputs_verify_guesses_under_their_grammar(pair):
    """Each guess of a structured request is checked against its grammar, and each row is
    sampled under the grammar's mask after the guesses before it."""
    texts = [
        (
            "Give the words of this sentence as a JSON list of strings: the cat sat on the "
            "mat, the dog sat on the log, the cow sat on the hay."
        ),
        "Repeat as JSON with a key text: the cat sat on the mat, the dog sat on the log.",
    ]
    prompts = _ids(pair[0], texts + COPYING[:1])
    from octavo.sampling_params import StructuredOutputsParams

    words = {"type": "array", "items": {"type": "string"}, "maxItems": 12}
    text = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
            "additionalProperties": False}  # fmt: skip
    params = [
        SamplingParams(temperature=0, max_tokens=60,
                       structured_outputs=StructuredOutputsParams(json=words)),
        SamplingParams(temperature=0, max_tokens=60,
                       structured_outputs=StructuredOutputsParams(json=text)),
        SamplingParams(temperature=0, max_tokens=30),
    ]  # fmt: skip
    accepted = _compare(pair, prompts[:2], params[:2])
    assert accepted > 10  # the structured requests themselves speculated
    _compare(pair, prompts, params)  # beside a plain one
    got = pair[1].generate(prompts_of(prompts[:2]), params[:2], use_tqdm=False)
    for out in got:
        if out.outputs[0].finish_reason == "stop":
            json.loads(out.outputs[0].text)


# ---- the distribution of unseeded samples, on a tiny model ------------------------------


class _ModeProposer:
    """Guesses the continuation of the most frequent completion: guesses that hold often,
    so that the test sees both accepted and rejected guesses in plenty."""

    def __init__(self, mode: tuple[int, ...], prompt_len: int):
        self.mode, self.prompt_len = mode, prompt_len

    def propose(self, requests, k):
        return [list(self.mode[r.num_output_tokens :][:k]) for r in requests]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=12, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)  # peaked enough that guesses often hold
    path = tmp_path_factory.mktemp("tiny12")
    model.save_pretrained(path)
    options = {"device": "cpu", "num_kv_blocks": 512, "max_model_len": 64, "quantization": None}
    plain = LLM(str(path), **options)
    spec = LLM(str(path), speculative_config={"num_speculative_tokens": 3}, **options)
    return plain, spec


def _histogram(llm, prompt, params, count):
    outs = llm.generate(prompts_of([prompt] * count), params, use_tqdm=False)
    hist: dict[tuple[int, ...], int] = {}
    for out in outs:
        key = tuple(out.outputs[0].token_ids)
        hist[key] = hist.get(key, 0) + 1
    return hist


def _p_value(a: dict, b: dict) -> float:
    """Chi-square test of one distribution behind two histograms (rare outcomes pooled)."""
    keys = sorted(set(a) | set(b), key=lambda k: -(a.get(k, 0) + b.get(k, 0)))
    common = [k for k in keys if a.get(k, 0) + b.get(k, 0) >= 20]
    table = [[a.get(k, 0) for k in common], [b.get(k, 0) for k in common]]
    rest = [sum(a.values()) - sum(table[0]), sum(b.values()) - sum(table[1])]
    if sum(rest):
        table[0].append(rest[0])
        table[1].append(rest[1])
    return chi2_contingency(table).pvalue


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True),
        pytest.param(
            SamplingParams(temperature=0.8, top_p=0.8, max_tokens=4, ignore_eos=True),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            SamplingParams(temperature=1.2, top_k=3, max_tokens=4, ignore_eos=True),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["temperature", "top_p", "top_k"],
)
def test_unseeded_samples_follow_the_same_distribution(tiny, params, monkeypatch):
    plain, spec = tiny
    prompt = [1, 5, 2, 7, 3, 1, 5, 2]
    want = _histogram(plain, prompt, params, 3000)
    mode = max(want, key=want.get)
    spec.engine.speculator.proposer = _ModeProposer(mode, len(prompt))
    before = spec.get_stats()
    got = _histogram(spec, prompt, params, 3000)
    after = spec.get_stats()
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    assert 0.2 * drafted < accepted < 0.95 * drafted, (accepted, drafted)
    assert _p_value(want, got) > 1e-3
    # The test can fail: keeping every guess gives another distribution.
    from octavo.runner import outputs

    monkeypatch.setattr(
        outputs,
        "_keep_verified",
        lambda result, rid, g: result.sampled_token_ids.__setitem__(
            rid, [*g, result.sampled_token_ids[rid][-1]]
        ),
    )
    wrong = _histogram(spec, prompt, params, 3000)
    assert _p_value(want, wrong) < 1e-6


def test_the_server_streams_the_same_answer_and_counts_the_guesses(pair):
    import httpx
    import openai
    from prometheus_client.parser import text_string_to_metric_families
    from server_fixture import ServerThread

    from octavo.entrypoints.openai.api_server import build_app

    plain, spec = pair
    messages = [{"role": "user", "content": COPYING[0]}]
    want = plain.chat(messages, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    with ServerThread(build_app(spec.engine, "m")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        answer = client.chat.completions.create(
            model="m", messages=messages, temperature=0, max_tokens=40
        )
        stream = client.chat.completions.create(
            model="m", messages=messages, temperature=0, max_tokens=40, stream=True
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        text = httpx.get(server.url + "/metrics").text
    assert answer.choices[0].message.content == streamed == want[0].outputs[0].text
    samples = {
        (s.name, s.labels.get("position")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("octavo_spec_decode_num_accepted_tokens_total", None)] > 0
    assert samples[("octavo_spec_decode_num_accepted_tokens_per_pos_total", "0")] > 0


# ---- a draft model ---------------------------------------------------------------------


def test_the_embedded_model_drafting_for_itself_keeps_every_guess(llm_factory):
    from octavo.checkpoint.embedded import embedded_model_path

    plain = llm_factory(quantization="auto")
    config = {"method": "draft_model", "model": embedded_model_path(), "num_speculative_tokens": 3}
    spec = llm_factory(quantization="auto", speculative_config=json.dumps(config))
    prompts = _ids(plain, CHAT_PROMPTS[:4] + COPYING[:2])
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=1)
    _compare((plain, spec), prompts, params)
    stats = spec.get_stats()
    # The same kernels, whatever the rows: the draft's greedy tokens are the target's.
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 50
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def _tiny_llama(path, seed: int, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    model.save_pretrained(path)
    return str(path)


def test_a_tiny_draft_for_a_tiny_target_gives_the_target_s_tokens(tmp_path):
    target = _tiny_llama(tmp_path / "target", 0, 3)
    draft = _tiny_llama(tmp_path / "draft", 1, 1)
    options = {"device": "cpu", "max_model_len": 128, "quantization": None}
    plain = LLM(target, num_kv_blocks=256, **options)
    config = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    spec = LLM(target, num_kv_blocks=24, speculative_config=config, **options)  # preempts
    prompts = [[(7 * i + j) % 96 for j in range(5 + 3 * i)] for i in range(6)]
    for params in [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=11, max_tokens=30, ignore_eos=True, n=2),
    ]:
        _compare((plain, spec), prompts, params)
    stats = spec.get_stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    assert stats["num_preemptions"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_a_draft_that_cannot_draft_is_a_value_error(tmp_path):
    target = _tiny_llama(tmp_path / "target", 0, 1)
    from transformers import LlamaConfig

    other = tmp_path / "other"
    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1,
                architectures=["LlamaForCausalLM"]).save_pretrained(other)  # fmt: skip
    with pytest.raises(ValueError, match=r"vocabulary \(64 tokens\) is not the target's \(96\)"):
        LLM(target, device="cpu", load_format="dummy",
            speculative_config={"method": "draft_model", "model": str(other)})  # fmt: skip
    with pytest.raises(ValueError, match="a draft model runs with tensor_parallel_size=1"):
        LLM(target, device="cpu", tensor_parallel_size=2,
            speculative_config={"method": "draft_model", "model": target})  # fmt: skip
