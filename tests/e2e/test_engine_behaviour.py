"""The engine end to end on the embedded model: caching, preemption and chunking never change
outputs; mixed sampling settings in a batch behave as alone; bad input is rejected cleanly."""

from __future__ import annotations

import pytest
from engine_utils import GREEDY, prompts_of, scheduling

from octavo import SamplingParams

# Greedy outputs of a few tokens: the reference's first tokens (greedy decoding takes the same
# tokens whatever max_tokens is), where KV that is read back wrong changes the first token.
SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def first_tokens(reference, n: int = SHORT.max_tokens) -> list[list[int]]:
    return [ids[:n] for ids in reference]


@pytest.fixture(scope="module")
def reference(greedy_reference):
    """Greedy tokens with no prefix caching, ample KV cache and no chunking."""
    return token_ids(greedy_reference)


def test_prefix_caching_on_gives_same_outputs_and_hits(llm_factory, chat_prompt_ids, reference):
    llm = llm_factory()
    before = llm.get_stats()
    # All chat prompts share the system prompt of the template: a long common prefix.
    outs = llm.generate(prompts_of(chat_prompt_ids), SHORT, use_tqdm=False)
    again = llm.generate(prompts_of(chat_prompt_ids), SHORT, use_tqdm=False)
    assert token_ids(outs) == first_tokens(reference)
    assert token_ids(again) == first_tokens(reference)
    stats = llm.get_stats()
    queries = stats["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = stats["prefix_cache_hits"] - before["prefix_cache_hits"]
    assert queries > 0 and hits / queries > 0.5


def test_reset_prefix_cache_forgets_the_cached_prompts(llm_factory, chat_prompt_ids, reference):
    llm = llm_factory()
    llm.generate(prompts_of(chat_prompt_ids[:2]), SHORT, use_tqdm=False)
    assert llm.reset_prefix_cache()  # nothing in use: every cached block forgotten
    before = llm.get_stats()["prefix_cache_hits"]
    outs = llm.generate(prompts_of(chat_prompt_ids[:1]), SHORT, use_tqdm=False)
    assert llm.get_stats()["prefix_cache_hits"] == before
    assert token_ids(outs) == first_tokens(reference)[:1]


@pytest.mark.slow
def test_small_kv_budget_preempts_and_gives_same_outputs(llm_factory, chat_prompt_ids, reference):
    # 8 prompts of ~40 tokens (3 blocks each) + 12 outputs need 32 blocks at once; give 14.
    llm = llm_factory(num_kv_blocks=14, enable_prefix_caching=False)
    before = llm.get_stats()["num_preemptions"]  # the engine is shared: count this run's
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts_of(chat_prompt_ids), params, use_tqdm=False)
    assert token_ids(outs) == first_tokens(reference, 12)
    stats = llm.get_stats()
    assert stats["num_preemptions"] > before
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


@pytest.mark.slow  # preemption and chunking run in the fast tests above and below
def test_small_kv_budget_with_prefix_caching(llm_factory, chat_prompt_ids, reference):
    llm = llm_factory(num_kv_blocks=14)
    before = llm.get_stats()["num_preemptions"]
    outs = llm.generate(prompts_of(chat_prompt_ids), GREEDY, use_tqdm=False)
    assert token_ids(outs) == reference
    assert llm.get_stats()["num_preemptions"] > before


@pytest.mark.parametrize(
    "num_prompts", [3, pytest.param(8, marks=pytest.mark.slow)], ids=["3-prompts", "8-prompts"]
)
def test_chunked_prefill_with_tiny_token_budget(
    llm_factory, chat_prompt_ids, reference, num_prompts
):
    """Prompts prefilled 7 tokens a step, beside the decodes: with 8 prompts, more running
    requests than the budget has tokens."""
    llm = llm_factory(max_num_batched_tokens=7, enable_prefix_caching=False)
    prompts = prompts_of(chat_prompt_ids[:num_prompts])
    outs = llm.generate(prompts, SHORT, use_tqdm=False)
    assert token_ids(outs) == first_tokens(reference[:num_prompts])


def test_outputs_come_back_in_input_order(llm, chat_prompt_ids):
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (9, 1, 5)]
    outs = llm.generate(prompts_of(chat_prompt_ids[:3]), params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [9, 1, 5]
    assert [o.prompt_token_ids for o in outs] == chat_prompt_ids[:3]


@pytest.mark.slow  # one generate per request alone
def test_mixed_sampling_params_behave_as_alone(llm, chat_prompt_ids):
    params = [
        SamplingParams(temperature=0, max_tokens=8),
        SamplingParams(temperature=0.9, top_p=0.8, seed=11, max_tokens=8),
        SamplingParams(temperature=1.2, top_k=5, seed=12, max_tokens=8),
        SamplingParams(temperature=0.7, min_p=0.1, seed=13, max_tokens=8),
        SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=8),
        SamplingParams(temperature=0, presence_penalty=1.5, frequency_penalty=0.5, max_tokens=8),
        SamplingParams(temperature=0, max_tokens=8, logprobs=3),
        SamplingParams(temperature=1.0, seed=14, max_tokens=8, min_tokens=5),
    ]
    prompts = prompts_of(chat_prompt_ids)
    together = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, together, strict=True):
        alone = llm.generate([prompt], p, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
        assert alone.outputs[0].text == out.outputs[0].text


def test_logprobs_are_returned_for_each_token(llm, chat_prompt_ids):
    out = llm.generate(
        prompts_of(chat_prompt_ids)[:1],
        SamplingParams(temperature=0, max_tokens=6, logprobs=2),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.logprobs) == 6
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entry and entry[token].rank == 1  # greedy picks the top token
        assert 2 <= len(entry) <= 3
        assert all(lp.logprob <= 0 for lp in entry.values())
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs, strict=True)), abs=1e-4
    )


def test_stop_string_ends_the_text_there(llm, chat_prompt_ids):
    prompt = prompts_of(chat_prompt_ids)[:1]
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    text = free[0].outputs[0].text
    stop = text[5:8]
    assert stop and stop in text
    cut = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert cut.text == text[: text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=24, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_a_stop_string_completed_by_the_last_allowed_token_finishes_as_stop(llm):
    """max_tokens and the stop string end the request on the same token: the text is cut at
    the stop string, so the reason is "stop" (vLLM's answer), not "length"."""
    prompt = "The history of the Roman Empire"
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ids = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    decode = llm.get_tokenizer().decode
    text, before_last = decode(ids), decode(ids[:-1])
    assert text.startswith(before_last) and len(text) > len(before_last)
    # The shortest tail of the text that starts inside the 7 tokens' text and is nowhere else.
    stop = next(text[i:] for i in range(len(before_last) - 1, -1, -1) if text.find(text[i:]) == i)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop])
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids
    assert out.text == text[: -len(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_the_token_that_stops_a_request_stays_out_of_its_text(llm, chat_prompt_ids):
    """EOS or a stop id: its id ends token_ids, its text is not in `text` (vLLM's rule)
    unless include_stop_str_in_output."""
    prompt = "The capital of France is"
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    decode = llm.get_tokenizer().decode
    j = next(j for j in range(1, 6) if decode([ids[j]]).strip() and ids[j] not in ids[:j])
    for keep in (False, True):
        params = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[ids[j]],
                                include_stop_str_in_output=keep)  # fmt: skip
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == ids[: j + 1]
        assert (out.finish_reason, out.stop_reason) == ("stop", ids[j])
        assert out.text == decode(ids[: j + 1 if keep else j])
    chat = prompts_of(chat_prompt_ids)[:1]
    params = SamplingParams(temperature=0, max_tokens=64, skip_special_tokens=False)
    out = llm.generate(chat, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm.engine.eos_token_ids
    assert out.text == decode(out.token_ids[:-1], skip_special_tokens=False)  # no <|im_end|>


def test_a_plain_prompt_gets_the_special_tokens_its_tokenizer_adds(llm, chat_prompt_ids):
    """A tokenizer that adds a BOS (Llama 3's) gets it on a text prompt, from LLM.generate
    and from /v1/completions, as in vLLM and HF; a chat template's rendering gets none."""
    import copy
    import types

    from tokenizers.processors import TemplateProcessing

    from octavo.entrypoints.openai.serving_completion import _prompt_ids

    tokenizer = llm.get_tokenizer()
    with_bos = copy.deepcopy(tokenizer)
    bos = with_bos.convert_tokens_to_ids("<|im_start|>")
    with_bos.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)]
    )
    plain = tokenizer.encode("Hello there", add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=1)
    llm.engine.tokenizer = with_bos
    try:
        (out,) = llm.generate("Hello there", params, use_tqdm=False)
        (chat,) = llm.chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False)
    finally:
        llm.engine.tokenizer = tokenizer
    assert out.prompt_token_ids == [bos, *plain]
    assert chat.prompt_token_ids.count(bos) == chat_prompt_ids[0].count(bos)  # the template's
    ctx = types.SimpleNamespace(
        tokenizer=with_bos, check_token_ids=lambda ids: None, check_prompt_chars=lambda n: None
    )
    assert _prompt_ids(ctx, "Hello there") == [[bos, *plain]]


def test_finish_reasons(llm, chat_prompt_ids):
    prompts = prompts_of(chat_prompt_ids)[:1]
    short = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert short[0].outputs[0].finish_reason == "length"
    full = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=200), use_tqdm=False)
    assert full[0].outputs[0].finish_reason == "stop"  # the model ends its answer with EOS


@pytest.mark.parametrize(
    "prompt, match",
    [
        ({"prompt_token_ids": [1, 2, 49152]}, "outside the vocabulary"),
        ({"prompt_token_ids": [-1]}, "outside the vocabulary"),
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": [5] * 10_000}, "max_model_len"),
    ],
)
def test_bad_prompts_are_rejected_and_the_engine_keeps_serving(llm, prompt, match):
    free = llm.get_stats()["kv_blocks_free"]
    with pytest.raises(ValueError, match=match):
        llm.generate(["Hello", prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.get_stats()["kv_blocks_free"] == free
    out = llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_abort_frees_blocks(llm, chat_prompt_ids):
    engine = llm.engine
    free = engine.get_stats()["kv_blocks_free"]
    request = engine.add_request(chat_prompt_ids[0], SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    assert engine.get_stats()["kv_blocks_free"] < free
    outs = engine.abort_request(request.request_id)
    assert outs[0].outputs[0].finish_reason == "abort"
    assert engine.get_stats()["kv_blocks_free"] == free
    assert not engine.has_unfinished_requests()


def test_stats_fields(llm):
    stats = llm.get_stats()
    for key in (
        "num_preemptions",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "kv_blocks_total",
        "kv_blocks_free",
    ):
        assert isinstance(stats[key], int)


def test_an_fp8_kv_cache_holds_four_times_float32s_blocks(llm, llm_factory):
    """kv_cache_dtype="fp8" stores one byte an element instead of float32's four: the same
    kv_cache_memory holds four times the blocks, and get_stats shows both."""
    plain, fp8 = llm.get_stats(), llm_factory(kv_cache_dtype="fp8").get_stats()
    assert (plain["kv_cache_dtype"], fp8["kv_cache_dtype"]) == ("float32", "float8_e4m3fn")
    assert fp8["kv_blocks_total"] // 4 == plain["kv_blocks_total"]


def test_logit_bias_and_allowed_token_ids_steer_only_their_request(
    llm, chat_prompt_ids, greedy_reference
):
    """OpenAI's logit_bias and vLLM's allowed_token_ids: +100 on a token makes greedy pick
    it every time; a random request keeps to its allowed tokens; a plain request batched
    with them gives its tokens alone."""
    prompts = prompts_of(chat_prompt_ids[:3])
    allowed = [11, 198, 2000, 30000]
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={42: 100.0}),
        SamplingParams(temperature=1.0, seed=2, max_tokens=16, ignore_eos=True,
                       allowed_token_ids=allowed),
        GREEDY,
    ]  # fmt: skip
    forced, kept, plain = llm.generate(prompts, params, use_tqdm=False)
    assert forced.outputs[0].token_ids == [42] * 6
    assert set(kept.outputs[0].token_ids) <= set(allowed)
    alone = greedy_reference[2]  # the third prompt alone
    assert plain.outputs[0].token_ids == alone.outputs[0].token_ids


def test_detokenize_false_gives_the_same_tokens_and_no_text(llm, chat_prompt_ids):
    """vLLM's detokenize=False (RL loops read token ids only): no text, no token texts in
    the log-probs, the same tokens."""
    prompt = prompts_of(chat_prompt_ids[:1])
    kwargs = {"temperature": 0, "max_tokens": 8, "logprobs": 1, "prompt_logprobs": 1}
    (text,) = llm.generate(prompt, SamplingParams(**kwargs), use_tqdm=False)
    (ids,) = llm.generate(prompt, SamplingParams(detokenize=False, **kwargs), use_tqdm=False)
    assert ids.outputs[0].token_ids == text.outputs[0].token_ids
    assert text.outputs[0].text and ids.outputs[0].text == ""
    entries = [*ids.outputs[0].logprobs, *ids.prompt_logprobs[1:]]
    assert all(lp.decoded_token is None for entry in entries for lp in entry.values())


def test_truncate_prompt_tokens_runs_the_prompts_last_tokens(llm, chat_prompt_ids):
    ids = chat_prompt_ids[0]
    params = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
    cut_params = SamplingParams(truncate_prompt_tokens=9, **params)
    (cut,) = llm.generate({"prompt_token_ids": ids}, cut_params, use_tqdm=False)
    (tail,) = llm.generate({"prompt_token_ids": ids[-9:]}, SamplingParams(**params),
                           use_tqdm=False)  # fmt: skip
    assert cut.prompt_token_ids == ids[-9:]
    assert cut.outputs[0].token_ids == tail.outputs[0].token_ids


def contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))


@pytest.mark.parametrize(
    "async_scheduling", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["sync", "async"]
)
def test_bad_words_keep_their_tokens_out_of_only_their_request(
    llm, chat_prompt_ids, greedy_reference, async_scheduling
):
    """vLLM's bad_words on "What is the capital of France?" (greedy: "The capital of France
    is Paris."): "Paris" never comes out, at a text's start or inside it; "capital of" never
    completes, though " capital" may. A plain request batched with them gives its tokens
    alone. With async scheduling too, where a word of several tokens needs the previous
    step's token on the host."""
    tok = llm.get_tokenizer()
    paris = [tok.encode(w, add_special_tokens=False) for w in ("Paris", " Paris")]
    capital_of = tok.encode(" capital of", add_special_tokens=False)
    assert all(len(ids) == 1 for ids in paris) and len(capital_of) == 2
    prompts = prompts_of([chat_prompt_ids[0], chat_prompt_ids[0], chat_prompt_ids[3]])
    plain, other = greedy_reference[0], greedy_reference[3]  # prompts 0 and 3 alone
    assert paris[1][0] in plain.outputs[0].token_ids  # the bans below have work to do
    assert contains(plain.outputs[0].token_ids, capital_of)
    greedy = {"temperature": 0, "max_tokens": GREEDY.max_tokens, "ignore_eos": True}  # GREEDY's
    params = [SamplingParams(bad_words=["Paris"], **greedy),
              SamplingParams(bad_words=["capital of"], **greedy), GREEDY]  # fmt: skip
    with scheduling(llm, async_scheduling):
        no_paris, no_capital_of, alone = llm.generate(prompts, params, use_tqdm=False)
    assert not {paris[0][0], paris[1][0]} & set(no_paris.outputs[0].token_ids)
    assert "Paris" not in no_paris.outputs[0].text
    ids = no_capital_of.outputs[0].token_ids
    assert capital_of[0] in ids and not contains(ids, capital_of)
    assert alone.outputs[0].token_ids == other.outputs[0].token_ids
    with pytest.raises(ValueError, match="bad_words"):
        llm.generate(prompts[:1], SamplingParams(bad_words=["\ud800"]), use_tqdm=False)
