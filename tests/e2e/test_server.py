"""The OpenAI-compatible server end to end: a real uvicorn server on the embedded model,
driven by the official `openai` client (sync and async) and by raw HTTP.

The server runs on the engine of the session's `llm`; reference outputs come from
`llm.generate` run on the server's engine thread (`AsyncEngine.call_sync`), so the engine is
never stepped by two threads at once.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_fixture import ServerThread, wait_for

import octavo
from octavo import SamplingParams
from octavo.entrypoints.openai.api_server import build_app
from octavo.entrypoints.openai.protocol import CompletionRequest
from octavo.tokenizer.tokenizer import apply_chat_template

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = [
    f"{opening} {topic}"
    for opening in (
        "Here is a short note about",
        "Tell me one fact about",
        "A poem on",
        "The history of",
    )
    for topic in (
        "the sea",
        "Paris",
        "prime numbers",
        "robots",
        "coffee",
        "winter",
        "the moon",
        "bicycles",
    )
]  # 32 distinct prompts


@pytest.fixture(scope="module")
def server(llm):
    with ServerThread(build_app(llm.engine, MODEL, api_key=API_KEY)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def reference(server, llm, prompts, params):
    """LLM.generate on the server's engine, run on its engine thread between steps."""
    return server.ctx.engine.call_sync(
        lambda _engine: llm.generate(prompts, params, use_tqdm=False), timeout=120
    )


def metrics(server) -> dict[str, float]:
    """Every sample of /metrics, keyed by name and labels."""
    text = httpx.get(server.url + "/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


# ---- the happy paths --------------------------------------------------------------------


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(server.url + "/health").status_code == 200


def test_completion_matches_llm_generate(server, client, llm):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    ref = reference(server, llm, PROMPTS[0], SamplingParams(temperature=0, max_tokens=12))[0]
    choice = out.choices[0]
    assert choice.text == ref.outputs[0].text
    assert choice.finish_reason == ref.outputs[0].finish_reason
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_token_id_prompt_and_a_list_of_prompts(server, client, llm):
    ids = llm.get_tokenizer().encode(PROMPTS[1], add_special_tokens=False)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    both = client.completions.create(
        model=MODEL, prompt=[PROMPTS[1], PROMPTS[2]], max_tokens=4, temperature=0
    )
    ref = reference(server, llm, PROMPTS[1:3], SamplingParams(temperature=0, max_tokens=4))
    assert by_ids.choices[0].text == ref[0].outputs[0].text
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == [r.outputs[0].text for r in ref]


def test_chat_whole_and_streamed_match_llm_chat(server, client, llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=8, temperature=0
    )
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True
    )
    chunks = list(stream)
    params = SamplingParams(temperature=0, max_tokens=8)
    ref = server.ctx.engine.call_sync(lambda _: llm.chat(messages, params, use_tqdm=False))[0]
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == ref.outputs[0].text
    assert (chunks[0].choices[0].delta.role, chunks[0].choices[0].delta.content) == (
        "assistant",
        "",
    )  # a role-only chunk opens the choice, as OpenAI's and vLLM's do
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == ref.outputs[0].finish_reason


@pytest.mark.slow  # 32 prompts twice; the other tests stream one or two requests
def test_32_concurrent_streams_match_llm_generate(server, llm):
    params = SamplingParams(temperature=0, max_tokens=8)
    ref = [r.outputs[0].text for r in reference(server, llm, PROMPTS, params)]

    async def one(aclient, prompt):
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True
        )
        pieces, finish = [], None
        async for chunk in stream:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        return "".join(pieces), finish

    async def run_all():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
        async with aclient:
            return await asyncio.gather(*(one(aclient, p) for p in PROMPTS))

    peak = []
    results = asyncio.run(_while_sampling(run_all(), server, peak))
    assert [text for text, _ in results] == ref
    assert all(finish in ("stop", "length") for _, finish in results)
    assert max(peak) > 1, "the requests never shared the running batch"


async def _while_sampling(work, server, peak: list[int]):
    """Runs `work`, recording how many requests run at once."""
    task = asyncio.ensure_future(work)
    while not task.done():
        peak.append(server.ctx.engine.stats["num_requests_running"])
        await asyncio.sleep(0.02)
    return await task


def test_stream_usage_and_ignore_eos(client):
    stream = client.completions.create(
        model=MODEL,
        prompt="Count to three:",
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "min_tokens": 2},
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"


def stream_events(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_chunks_open_with_the_role_and_carry_usage_as_openai(server, include_usage):
    """Chat: each of the n choices opens with a role-only chunk. Both endpoints: `usage` is
    absent from chunks without include_usage; with it, null in every chunk but the last,
    which holds the totals and no choices."""
    options = {"stream_options": {"include_usage": True}} if include_usage else {}
    common = {"model": MODEL, "max_tokens": 6, "temperature": 1, "seed": 3, "n": 2,
              "ignore_eos": True, "stream": True} | options  # fmt: skip
    messages = [{"role": "user", "content": "Name a color."}]
    chat = stream_events(server, "/v1/chat/completions", common | {"messages": messages})
    text = stream_events(server, "/v1/completions", common | {"prompt": PROMPTS[0]})
    opening = [(e["choices"][0]["index"], e["choices"][0]["delta"]) for e in chat[:2]]
    assert opening == [(0, {"role": "assistant", "content": ""}),
                       (1, {"role": "assistant", "content": ""})]  # fmt: skip
    assert all(e["choices"][0]["delta"]["role"] is None for e in chat[2:] if e["choices"])
    for events in (chat, text):
        if include_usage:
            assert all("usage" in e and e["usage"] is None for e in events[:-1])
            assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12
        else:
            assert not any("usage" in e for e in events)


def test_stop_string_cuts_the_text(client):
    full = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=12, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"no usable stop string in {text!r}"
    cut = client.completions.create(
        model=MODEL, prompt=PROMPTS[3], max_tokens=12, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].model_extra["stop_reason"] == stop  # vLLM's field


def test_stop_reason_names_the_stop_id_streamed_or_whole(server, llm):
    """vLLM's `stop_reason`: the stop token id (or string) that ended a choice."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = server.ctx.engine.call_sync(lambda _: llm.generate(PROMPTS[3], params, use_tqdm=False))
    ids = ref[0].outputs[0].token_ids
    stop_id = ids[next(j for j in range(1, 8) if ids[j] not in ids[:j])]
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 8, "temperature": 0,
            "stop_token_ids": [stop_id]}  # fmt: skip
    url = server.url + "/v1/completions"
    whole = httpx.post(url, json=body, headers=AUTH, timeout=60).json()["choices"][0]
    assert (whole["finish_reason"], whole["stop_reason"]) == ("stop", stop_id)
    with httpx.stream("POST", url, json=body | {"stream": True}, headers=AUTH, timeout=60) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data: {")]
    last = events[-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop_id)
    assert all(e["choices"][0]["stop_reason"] is None for e in events[:-1])


@pytest.mark.slow  # chat replies run to EOS
def test_vllm_extra_fields_are_honoured(server, llm):
    """include_stop_str_in_output, skip_special_tokens and continue_final_message were
    accepted and ignored."""
    chat_url, url = server.url + "/v1/chat/completions", server.url + "/v1/completions"

    def post(url, body):
        r = httpx.post(url, json={"model": MODEL, "temperature": 0} | body, headers=AUTH,
                       timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    text = post(url, {"prompt": PROMPTS[3], "max_tokens": 12})["text"]
    stop = text[4:7]
    kept = post(url, {"prompt": PROMPTS[3], "max_tokens": 12, "stop": [stop],
                      "include_stop_str_in_output": True})  # fmt: skip
    assert kept["text"] == text[: text.index(stop) + len(stop)]
    hello = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 64}
    special = post(chat_url, hello | {"skip_special_tokens": False,
                                      "include_stop_str_in_output": True})  # fmt: skip
    plain = post(chat_url, hello | {"include_stop_str_in_output": True})
    assert special["message"]["content"] == plain["message"]["content"] + "<|im_end|>"
    conversation = [{"role": "user", "content": "Name a colour."},
                    {"role": "assistant", "content": "The colour is a"}]  # fmt: skip
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    cont = post(chat_url, {"messages": conversation, "max_tokens": 8} | flags)
    params = SamplingParams(temperature=0, max_tokens=8)
    ref = server.ctx.engine.call_sync(
        lambda _: llm.chat(conversation, params, use_tqdm=False, **flags)
    )[0].outputs[0]
    fresh = post(chat_url, {"messages": conversation, "max_tokens": 8})
    assert cont["message"]["content"] == ref.text != fresh["message"]["content"]
    both = {"messages": conversation, "continue_final_message": True}
    r = httpx.post(chat_url, json={"model": MODEL} | both, headers=AUTH, timeout=60)
    _assert_error(r, 400)
    assert r.json()["error"]["param"] == "continue_final_message"


def test_seeded_sampling_repeats(client):
    def sample():
        return (
            client.completions.create(
                model=MODEL,
                prompt=PROMPTS[4],
                max_tokens=6,
                temperature=1.0,
                top_p=0.9,
                seed=1234,
                extra_body={"top_k": 40, "min_p": 0.01, "repetition_penalty": 1.1},
            )
            .choices[0]
            .text
        )

    assert sample() == sample()


def test_completion_logprobs_shape(client):
    out = client.completions.create(
        model=MODEL, prompt=PROMPTS[5], max_tokens=6, temperature=0, logprobs=2
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 2 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the most likely
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


@pytest.mark.slow  # the shape of completion log-probs is in the core run
def test_completion_top_logprobs_hold_the_sampled_token(client):
    """vLLM's and OpenAI's legacy shape: the sampled token first, then the k most likely
    others, so k + 1 entries when it is not among them; logprobs=0 gives it alone."""
    for k in (0, 2):
        out = client.completions.create(
            model=MODEL, prompt=PROMPTS[5], max_tokens=24, temperature=5.0, seed=3, logprobs=k
        )
        lp = out.choices[0].logprobs
        for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            assert next(iter(top.items())) == (token, chosen)
            others = list(top.values())[1:]
            assert len(others) == k - 1 or (len(others) == k and min(others, default=0) >= chosen)
        if k:  # a hot temperature samples unlikely tokens: some fall outside the top k
            assert any(len(top) == k + 1 for top in lp.top_logprobs)


def test_chat_logprobs_shape(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode() == entry.token


def test_echo_gives_the_prompt_and_its_logprobs(server, llm):
    """OpenAI's `echo`: the prompt's text in front of the completion, and with `logprobs`
    the prompt's tokens scored (the first has none); max_tokens 0 gives the prompt alone,
    as lm-eval's log-likelihood requests send it."""
    prompt = PROMPTS[5]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=1)
    (ref,) = reference(server, llm, prompt, params)
    ids = ref.prompt_token_ids
    scored = [entry[t].logprob for entry, t in zip(ref.prompt_logprobs[1:], ids[1:], strict=True)]
    url = server.url + "/v1/completions"
    body = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 1, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    alone = httpx.post(url, json=body | {"max_tokens": 0}, headers=AUTH, timeout=60).json()
    choice = alone["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and "".join(lp["tokens"]) == prompt
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(scored, abs=1e-4)
    assert all(len(top) in (1, 2) for top in lp["top_logprobs"][1:])
    assert lp["text_offset"][-1] == len(prompt) - len(lp["tokens"][-1])

    whole = httpx.post(url, json=body | {"max_tokens": 3}, headers=AUTH, timeout=60).json()
    choice = whole["choices"][0]
    assert choice["text"] == prompt + ref.outputs[0].text
    assert len(choice["logprobs"]["tokens"]) == len(ids) + 3
    assert choice["logprobs"]["token_logprobs"][1 : len(ids)] == pytest.approx(scored, abs=1e-4)

    streamed = stream_events(server, "/v1/completions", body | {"max_tokens": 3, "stream": True})
    texts = [e["choices"][0]["text"] for e in streamed]
    assert texts[0].startswith(prompt) and "".join(texts) == prompt + ref.outputs[0].text


def test_vllm_prompt_logprobs_field(server, llm):
    """vLLM's `prompt_logprobs`: per prompt token, null then {token id: {logprob, rank,
    decoded_token}}; on each completion choice, and on a chat response."""
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    (ref,) = reference(server, llm, PROMPTS[2], params)
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 2, "temperature": 0,
            "prompt_logprobs": 2, "n": 2}  # fmt: skip
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        found = choice["prompt_logprobs"]
        assert found[0] is None and len(found) == len(ref.prompt_token_ids)
        for entry, want in zip(found[1:], ref.prompt_logprobs[1:], strict=True):
            assert sorted(entry) == sorted(str(t) for t in want)
            for t, lp in want.items():
                got = entry[str(t)]
                assert (got["rank"], got["decoded_token"]) == (lp.rank, lp.decoded_token)
                assert got["logprob"] == pytest.approx(lp.logprob, abs=1e-4)
    messages = [{"role": "user", "content": "Hi"}]
    chat = {"model": MODEL, "messages": messages, "max_tokens": 2, "prompt_logprobs": 0}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, headers=AUTH, timeout=60)
    found = r.json()["prompt_logprobs"]
    assert found[0] is None and all(len(entry) == 1 for entry in found[1:]), found
    plain = httpx.post(server.url + "/v1/completions", json=body | {"prompt_logprobs": None},
                       headers=AUTH, timeout=60).json()  # fmt: skip
    assert all(c["prompt_logprobs"] is None for c in plain["choices"])


def test_logit_bias_and_allowed_token_ids(server, client, llm):
    """OpenAI's logit_bias (clamped to [-100, 100], as vLLM does) and vLLM's
    allowed_token_ids give what SamplingParams' fields give."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={42: 100.0})
    (ref,) = reference(server, llm, PROMPTS[1], params)
    out = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0, logit_bias={"42": 1000},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert out.choices[0].text == ref.outputs[0].text
    messages = [{"role": "user", "content": "Say something."}]
    params = SamplingParams(temperature=0, max_tokens=5, allowed_token_ids=[11, 198, 2000])
    ref = server.ctx.engine.call_sync(lambda _: llm.chat(messages, params, use_tqdm=False))[0]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0,
        extra_body={"allowed_token_ids": [11, 198, 2000]},
    )  # fmt: skip
    assert out.choices[0].message.content == ref.outputs[0].text


def test_bad_words(server, client, llm):
    """vLLM's bad_words: what SamplingParams' field gives, for chat and completions; a
    word with nothing but spaces is a 400 that names the field."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0, max_tokens=8, bad_words=["Paris"])
    ref = server.ctx.engine.call_sync(lambda _: llm.chat(messages, params, use_tqdm=False))[0]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0,
        extra_body={"bad_words": ["Paris"]},
    )  # fmt: skip
    assert out.choices[0].message.content == ref.outputs[0].text
    assert "Paris" not in ref.outputs[0].text
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 2, "bad_words": [" "]}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    _assert_error(r, 400)
    assert r.json()["error"]["param"] == "bad_words"


def test_structured_outputs_through_response_format_and_vllms_fields(server, client):
    """OpenAI's response_format (json_schema, json_object) and vLLM's structured_outputs
    and guided_* fields hold the text to their constraint, whole or streamed."""
    person = {"type": "object", "properties": {"name": {"type": "string"},
              "age": {"type": "integer"}}, "required": ["name", "age"],
              "additionalProperties": False}  # fmt: skip
    messages = [{"role": "user", "content": "Give me a person as JSON."}]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": person}},
    )  # fmt: skip
    assert set(json.loads(out.choices[0].message.content)) == {"name", "age"}
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                         temperature=0, response_format={"type": "json_object"})  # fmt: skip
    assert out.choices[0].message.content.startswith("{")
    out = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=0,
                                    extra_body={"structured_outputs": {"choice": ["odd", "even"]}})  # fmt: skip
    assert out.choices[0].text in ("odd", "even") and out.choices[0].finish_reason == "stop"
    out = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=0,
                                    extra_body={"guided_regex": "[0-9]{2,4}"})  # fmt: skip
    assert re.fullmatch("[0-9]{2,4}", out.choices[0].text)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True,
        extra_body={"guided_choice": ["Ada", "Grace"]},
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text in ("Ada", "Grace")


def test_tokenize_and_detokenize_as_vllm(server):
    """vLLM's /tokenize gives the ids that a completion or a chat completion runs on (their
    usage counts as many), /detokenize gives the ids' text; bad input is a 400 naming the
    field. /version answers too."""
    tok, url = server.ctx.tokenizer, server.url
    body = {"model": MODEL, "prompt": PROMPTS[1], "return_token_strs": True}
    found = httpx.post(url + "/tokenize", json=body, headers=AUTH, timeout=60).json()
    assert found["tokens"] == tok.encode(PROMPTS[1], add_special_tokens=True)
    assert found["token_strs"] == tok.convert_ids_to_tokens(found["tokens"])
    assert found["count"] == len(found["tokens"])
    assert found["max_model_len"] == server.ctx.max_model_len
    completion = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 1}
    r = httpx.post(url + "/v1/completions", json=completion, headers=AUTH, timeout=60)
    assert r.json()["usage"]["prompt_tokens"] == found["count"]
    messages = [{"role": "user", "content": "Hi there"}]
    found = httpx.post(
        url + "/tokenize", json={"messages": messages}, headers=AUTH, timeout=60
    ).json()
    assert found["tokens"] == apply_chat_template(tok, messages) and found["token_strs"] is None
    chat = {"model": MODEL, "messages": messages, "max_tokens": 1}
    r = httpx.post(url + "/v1/chat/completions", json=chat, headers=AUTH, timeout=60)
    assert r.json()["usage"]["prompt_tokens"] == found["count"]
    r = httpx.post(url + "/detokenize", json={"tokens": found["tokens"]}, headers=AUTH, timeout=60)
    assert r.json() == {"prompt": tok.decode(found["tokens"])}
    for path, bad, param in [
        ("/detokenize", {"tokens": [5, -1]}, "tokens"),
        ("/detokenize", {"tokens": [len(tok)]}, "tokens"),
        ("/tokenize", {"prompt": "\ud800"}, "prompt"),
        ("/tokenize", {"messages": messages, "continue_final_message": True},
         "continue_final_message"),
    ]:  # fmt: skip
        r = httpx.post(url + path, content=json.dumps(bad), timeout=60,  # \ud800 escaped
                       headers={"Content-Type": "application/json", **AUTH})  # fmt: skip
        _assert_error(r, 400)
        assert r.json()["error"]["param"] == param, (path, bad, r.text)
    r = httpx.post(
        url + "/tokenize", json={"model": "other", "prompt": "x"}, headers=AUTH, timeout=60
    )
    _assert_error(r, 404)
    assert (
        httpx.get(url + "/version", headers=AUTH, timeout=60).json()["version"]
        == octavo.__version__
    )


def test_truncate_prompt_tokens_lets_a_long_prompt_in(server):
    """vLLM's truncate_prompt_tokens: the last k tokens of a prompt longer than the context,
    before the context is checked; echo gives their text."""
    long = _long_prompt(server.ctx.max_model_len + 10)
    body = {"model": MODEL, "prompt": long, "max_tokens": 2, "truncate_prompt_tokens": 8,
            "echo": True}  # fmt: skip
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 8
    text = r.json()["choices"][0]["text"]
    assert text.startswith(server.ctx.tokenizer.decode(long[-8:]))
    r = httpx.post(server.url + "/v1/completions", json=body | {"truncate_prompt_tokens": 0},
                   headers=AUTH, timeout=60)  # fmt: skip
    _assert_error(r, 400)
    assert r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_n_gives_n_choices(server):
    body = {
        "model": MODEL,
        "prompt": PROMPTS[6],
        "max_tokens": 4,
        "n": 2,
        "temperature": 1,
        "ignore_eos": True,
    }
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == [0, 1]
    assert r.json()["usage"]["completion_tokens"] == 8


def test_null_means_the_default_as_openai_clients_send_it(server):
    """openai-python sends null for a parameter set to None (n=None, stream=None); a field
    with a default takes it, and completions' max_tokens null still means no limit."""
    body = {
        "model": MODEL,
        "prompt": PROMPTS[7],
        "max_tokens": 3,
        "n": None,
        "stream": None,
        "echo": None,
        "stream_options": None,
        "ignore_eos": None,
        "temperature": None,
    }
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["usage"]["completion_tokens"] <= 3
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "n": None,
        "logprobs": None,
        "stream": None,
        "add_generation_prompt": None,
    }
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None
    # A field that may be None keeps its null: completions' max_tokens then means no limit
    # (the room left in the context), not the default 16.
    assert CompletionRequest.model_validate({"prompt": "x", "max_tokens": None}).max_tokens is None
    assert CompletionRequest.model_validate({"prompt": "x"}).max_tokens == 16


# ---- cancellation, failures, errors ---------------------------------------------------


def test_disconnect_aborts_and_frees_kv_blocks(server):
    engine = server.ctx.engine
    # An earlier test's aborted stream may still be finishing: start from an idle engine.
    assert wait_for(
        lambda: engine.stats["num_requests_running"] + engine.stats["num_requests_waiting"] == 0
    )
    free_before = server.ctx.engine.stats["kv_blocks_free"]
    aborts_before = metrics(server).get("octavo_requests_total{outcome=abort}", 0)
    body = {
        "model": MODEL,
        "prompt": PROMPTS[7],
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    url = server.url + "/v1/completions"
    with httpx.Client(timeout=60) as h, h.stream("POST", url, json=body, headers=AUTH) as r:
        received = []
        for line in r.iter_lines():
            if line.startswith("data:"):
                received.append(line)
            if len(received) == 3:
                break
        assert server.ctx.engine.stats["kv_blocks_free"] < free_before
    assert wait_for(lambda: server.ctx.engine.stats["kv_blocks_free"] == free_before)
    assert server.ctx.engine.stats["num_requests_running"] == 0
    assert metrics(server)["octavo_requests_total{outcome=abort}"] == aborts_before + 1


def test_a_failing_step_fails_its_requests_and_the_server_goes_on(server, client):
    runner = server.ctx.engine.engine.runner

    def explode(*args, **kwargs):
        raise RuntimeError("injected failure")

    server.ctx.engine.call_sync(lambda _: setattr(runner, "execute_async", explode))
    try:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
        r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    finally:
        server.ctx.engine.call_sync(lambda _: delattr(runner, "execute_async"))
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    assert "injected failure" in r.json()["error"]["message"]
    stats = server.ctx.engine.stats
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).choices[0].text


def _long_prompt(n: int) -> list[int]:
    return [1000 + i % 100 for i in range(n)]


ERROR_CASES = {
    "bad temperature": (400, "/v1/completions", {"prompt": "hi", "temperature": -1.0}),
    "temperature as text": (400, "/v1/completions", {"prompt": "hi", "temperature": "hot"}),
    "no prompt": (400, "/v1/completions", {"max_tokens": 3}),
    "empty prompt": (400, "/v1/completions", {"prompt": ""}),
    "token id out of vocab": (400, "/v1/completions", {"prompt": [10**9]}),
    "out of vocab, streamed": (400, "/v1/completions", {"prompt": [10**9], "stream": True}),
    "prompt + max_tokens too long": (400, "/v1/completions", {"prompt": "hi", "max_tokens": 10**7}),
    "top_logprobs without logprobs": (
        400,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
    ),
    "message without content": (400, "/v1/chat/completions", {"messages": [{"role": "user"}]}),
    "no messages": (400, "/v1/chat/completions", {"messages": []}),
    "image content": (
        400,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    ),
    "lone surrogate in the prompt": (400, "/v1/completions", {"prompt": "\ud800 hi"}),
    "lone surrogate in a message": (
        400,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi \udfff"}]},
    ),
    "logit_bias key not a token id": (
        400,
        "/v1/completions",
        {"prompt": "hi", "logit_bias": {"the": 5.0}},
    ),
    "logit_bias NaN": (400, "/v1/completions", {"prompt": "hi", "logit_bias": {"5": float("nan")}}),
    "logit_bias beyond the vocabulary": (
        400,
        "/v1/completions",
        {"prompt": "hi", "logit_bias": {"49152": 5.0}},
    ),
    "stream_options without stream": (
        400,
        "/v1/completions",
        {"prompt": "hi", "stream_options": {"include_usage": True}},
    ),
    "unknown model": (404, "/v1/completions", {"prompt": "hi", "model": "gpt-17"}),
    "unknown model with a lone surrogate": (
        404,
        "/v1/completions",
        {"prompt": "hi", "model": "m\ud800"},
    ),
    "echo of a token id out of vocab": (400, "/v1/completions", {"prompt": [-1, 5], "echo": True}),
    "echo of a huge token id": (400, "/v1/completions", {"prompt": [2**64], "echo": True}),
    "prompt_logprobs streamed": (
        400,
        "/v1/completions",
        {"prompt": "hi", "prompt_logprobs": 1, "stream": True},
    ),
    "temperature beyond float32": (400, "/v1/completions", {"prompt": "hi", "temperature": 1e39}),
    "best_of 0": (400, "/v1/completions", {"prompt": "hi", "best_of": 0}),
    "best_of below n": (400, "/v1/completions", {"prompt": "hi", "best_of": 1, "n": 3}),
    "unknown chat model": (
        404,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-17"},
    ),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_bad_requests_get_openai_errors_and_the_server_goes_on(server, client, case):
    status, path, body = ERROR_CASES[case]
    errors_before = metrics(server).get("octavo_requests_total{outcome=error}", 0)
    # json.dumps writes a lone surrogate as the escape "\ud800", as a client's JSON may.
    raw = json.dumps({"model": MODEL, **body}).encode()
    headers = AUTH | {"Content-Type": "application/json"}
    r = httpx.post(server.url + path, content=raw, headers=headers, timeout=60)
    _assert_error(r, status)
    assert metrics(server)["octavo_requests_total{outcome=error}"] == errors_before + 1
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text


@pytest.mark.parametrize("bad", [10**9, -1])
def test_every_prompts_ids_are_checked_before_any_prompt_runs(server, monkeypatch, bad):
    """With the engine in its own process, a prompt the engine refused last let the others
    stream first under a 200 (a race); the server refuses the whole request up front."""
    runs = []
    generate = server.ctx.generate
    monkeypatch.setattr(server.ctx, "generate", lambda *a: runs.append(a) or generate(*a))
    body = {"model": MODEL, "prompt": [[5, 6, 7]] * 4 + [[8, bad]], "stream": True}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    _assert_error(r, 400)
    assert r.json()["error"]["param"] == "prompt" and f"id {bad} is outside" in r.text
    assert runs == []


def test_prompt_longer_than_the_context_is_a_400(server, client):
    n = server.ctx.max_model_len + 1
    body = {"model": MODEL, "prompt": _long_prompt(n), "max_tokens": 1}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    _assert_error(r, 400)
    assert "maximum context length" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "path, body, param, words",
    [
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs",
         "top_logprobs"),
        ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens",
         "max_completion_tokens"),
        ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens", "max_tokens"),
        ("/v1/chat/completions", {"prompt_logprobs": 21}, "prompt_logprobs", "prompt_logprobs"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"49152": 1}}, "logit_bias",
         "vocabulary"),
        ("/v1/completions", {"prompt": [5, 10**9]}, "prompt", "vocabulary"),
        ("/v1/completions", {"prompt": "long", "max_tokens": None}, "prompt", "no room"),
        ("/v1/completions", {"prompt": "long", "max_tokens": 16}, "prompt", "no room"),
        ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format",
         "json_schema, got 'xml'"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema"}},
         "response_format", "json_schema.schema"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema",
         "json_schema": "x"}}, "response_format", "json_schema.schema"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"},
         "guided_regex": "a"}, "guided_regex", "one structured output"),
        ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "("}},
         "structured_outputs", "does not compile"),
        ("/v1/completions", {"prompt": "hi", "structured_outputs": {"choice": []}},
         "structured_outputs", "non-empty list"),
        ("/v1/completions", {"prompt": "hi", "structured_outputs": {"xml": "a"}},
         "structured_outputs", "xml"),
        ("/v1/completions", {"prompt": "hi", "guided_json": "{bad"}, "structured_outputs",
         "not valid JSON"),
    ],
)  # fmt: skip
def test_errors_name_the_requests_own_field(server, path, body, param, words):
    if body.get("prompt") == "long":
        body["prompt"] = _long_prompt(server.ctx.max_model_len)
    elif "prompt" not in body:
        body["messages"] = [{"role": "user", "content": "hi"}]
    r = httpx.post(server.url + path, json={"model": MODEL, **body}, headers=AUTH, timeout=60)
    _assert_error(r, 400)
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize(
    "raw, headers",
    [
        (b'{"prompt": "hi", ', {"Content-Type": "application/json"}),  # malformed JSON
        (b"[1, 2, 3]", {"Content-Type": "application/json"}),  # not an object
        (b"prompt=hi", {"Content-Type": "application/x-www-form-urlencoded"}),
    ],
)
def test_malformed_bodies_are_400(server, client, raw, headers):
    r = httpx.post(server.url + "/v1/completions", content=raw, headers=AUTH | headers)
    _assert_error(r, 400)
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}]
)
def test_missing_or_wrong_api_key_is_401(server, client, headers):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=headers)
    _assert_error(r, 401)
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/health").status_code == 200  # open without a key
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text


def test_openai_client_raises_its_typed_errors(server, client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt="hi")
    stranger = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.completions.create(model=MODEL, prompt="hi")


def _assert_error(r: httpx.Response, status: int) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]


# ---- metrics and the benchmark ------------------------------------------------------


def test_metrics_parse_and_move_with_traffic(server, client):
    before = metrics(server)
    client.completions.create(
        model=MODEL, prompt=PROMPTS[8], max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    httpx.post(
        server.url + "/v1/completions", json={"prompt": "hi", "temperature": -1}, headers=AUTH
    )
    after = metrics(server)

    def moved(name):
        return after.get(name, 0) - before.get(name, 0)

    assert moved("octavo_requests_total{outcome=length}") == 1
    assert moved("octavo_requests_total{outcome=error}") == 1
    assert moved("octavo_time_to_first_token_seconds_count") == 1
    assert moved("octavo_time_per_output_token_seconds_count") == 1
    assert moved("octavo_e2e_request_latency_seconds_count") == 1
    assert moved("octavo_generation_tokens_total") == 5
    assert moved("octavo_engine_steps_total") >= 5
    assert after["octavo_kv_blocks_total"] == server.ctx.engine.stats["kv_blocks_total"] > 0
    assert after["octavo_kv_blocks_used"] == 0
    assert after["octavo_num_requests_running"] == after["octavo_num_requests_waiting"] == 0
    assert 0 <= after["octavo_prefix_cache_hit_rate"] <= 1
    assert "octavo_num_preemptions_total" in after


@pytest.mark.slow  # test_bench_serve.py runs the benchmark on a tiny model
def test_bench_serve_reports_its_metrics(server, tmp_path, capsys):
    from octavo.entrypoints import cli

    out_json = tmp_path / "bench.json"
    argv = [
        "bench",
        "serve",
        "--base-url",
        server.url,
        "--api-key",
        API_KEY,
        "--num-prompts",
        "6",
        "--request-rate",
        "20",
        "--max-tokens",
        "8",
        "--input-len",
        "16",
        "--json",
        str(out_json),
    ]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    for label in (
        "Request throughput",
        "Output token throughput",
        "Mean TTFT",
        "P99 TPOT",
        "Median ITL",
    ):
        assert label in printed
    summary = json.loads(out_json.read_text())
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 6 * 8  # ignore_eos: every request runs to max
    assert summary["mean_ttft_ms"] > 0 and summary["mean_tpot_ms"] > 0
    assert summary["model"] == MODEL


def test_serve_command_defaults_to_loopback():
    from octavo.entrypoints import cli

    args = cli.build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.api_key, args.model) == ("127.0.0.1", 8000, None, None)
