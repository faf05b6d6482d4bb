"""Tool calls through the official `openai` client against the server: the embedded model
with a hermes-style template passed as a chat template, and a tiny random Qwen2 checkpoint
with the same template. Required and named calls always give arguments that parse and
validate against their schema (hypothesis over schemas); streamed calls assemble to the
whole reply; a tool's result goes back into the conversation; bad tools are 400s."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_fixture import ServerThread

from octavo.entrypoints.openai.api_server import build_app
from octavo.entrypoints.openai.serving import ChatOptions

TEMPLATE = (Path(__file__).parent / "templates" / "hermes.jinja").read_text()
QUESTION = [{"role": "user", "content": "What is the weather in Paris, in Celsius?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def server(llm_factory):
    llm = llm_factory(quantization="auto")
    app = build_app(
        llm.engine, "m", chat=ChatOptions(reasoning_parser="qwen3"), chat_template=TEMPLATE
    )
    with ServerThread(app) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def _streamed(client, **request):
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **request):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": None, "name": None, "arguments": ""})
            if call.function.name is not None:
                assert entry["name"] is None, "the name comes once"
                entry["name"], entry["id"] = call.function.name, call.id
            entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"],
)
def test_required_and_named_calls_parse_and_stream_alike(client, choice):
    request = {"model": "m", "messages": QUESTION, "tools": [WEATHER, TIME],
               "tool_choice": choice, "temperature": 0, "max_tokens": 120}  # fmt: skip
    reply = client.chat.completions.create(**request)
    message = reply.choices[0].message
    assert message.tool_calls and message.content is None
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"
    if isinstance(choice, dict):
        assert [c.function.name for c in message.tool_calls] == ["get_time"]
        assert reply.choices[0].finish_reason == "tool_calls"
    content, calls, finish = _streamed(client, **request)
    assert content is None and finish == reply.choices[0].finish_reason
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls
    ]


def test_a_tool_result_goes_back_into_the_conversation(client):
    first = client.chat.completions.create(
        model="m", messages=QUESTION, tools=[WEATHER], temperature=0, max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    history = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    answer = client.chat.completions.create(
        model="m", messages=history, tools=[WEATHER], tool_choice="none", temperature=0,
        max_tokens=24,
    )  # fmt: skip
    assert answer.choices[0].message.tool_calls in (None, [])
    assert answer.choices[0].message.content


def test_auto_leaves_text_free_and_keeps_markup_out_of_content(client):
    for question in ("Say hello.", QUESTION[0]["content"]):
        messages = [{"role": "user", "content": question}]
        request = {"model": "m", "messages": messages, "tools": [WEATHER], "temperature": 0,
                   "max_tokens": 60}  # fmt: skip
        message = client.chat.completions.create(**request).choices[0].message
        assert "<tool_call>" not in (message.content or "")
        content, calls, _ = _streamed(client, **request)
        assert content == message.content
        assert [c["name"] for c in calls] == [c.function.name for c in message.tool_calls or []]


@pytest.mark.parametrize(
    ("request_fields", "param", "message"),
    [
        ({"tool_choice": "required"}, "tool_choice", "needs `tools`"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice", "not in `tools`"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools",
         "name must be"),
        ({"tools": [{"type": "function", "function": {"name": "f",
                                                      "parameters": {"type": "no-such"}}}],
          "tool_choice": "required"}, None, "does not compile"),
        ({"tools": [WEATHER], "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "tool_choice", "exclude each other"),
    ],
)  # fmt: skip
def test_bad_tools_are_400s_naming_the_field(client, request_fields, param, message):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=QUESTION, max_tokens=4, **request_fields)
    assert message in info.value.body["message"]
    if param is not None:
        assert info.value.body["param"] == param


def test_a_template_without_tools_is_a_400(llm_factory):
    llm = llm_factory(quantization="auto")
    with ServerThread(build_app(llm.engine, "m")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="does not take `tools`"):
            client.chat.completions.create(model="m", messages=QUESTION, tools=[WEATHER])


def test_a_json_schema_applies_after_the_reasoning(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}  # fmt: skip
    response_format = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
    reply = client.chat.completions.create(
        model="m", messages=QUESTION, response_format=response_format, temperature=0,
        max_tokens=40,
    )  # fmt: skip
    message = reply.choices[0].message
    jsonschema.validate(json.loads(message.content), schema)


# ---- any schema -------------------------------------------------------------------------

_leaf = st.one_of(
    st.just({"type": "string", "maxLength": 8}),
    st.just({"type": "boolean"}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.lists(st.sampled_from(["red", "green", "blue", "x y"]), min_size=1, max_size=3,
             unique=True).map(lambda e: {"enum": e}),
)  # fmt: skip


def _object(children):
    return st.dictionaries(
        st.sampled_from(["a", "b", "name", "items", "n"]), children, min_size=1, max_size=3
    ).map(
        lambda props: {
            "type": "object",
            "properties": props,
            "required": sorted(props),
            "additionalProperties": False,
        }
    )


_schema = _object(
    st.one_of(
        _leaf,
        st.builds(lambda item: {"type": "array", "items": item, "maxItems": 2}, _leaf),
        _object(_leaf),
    )
)


@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,  # the same schemas every run
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(schema=_schema)
def test_required_calls_validate_against_any_schema(client, schema):
    tool = {"type": "function", "function": {"name": "act", "parameters": schema}}
    reply = client.chat.completions.create(
        model="m", messages=QUESTION, tools=[tool], tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=200,
    )  # fmt: skip
    calls = reply.choices[0].message.tool_calls
    assert calls and reply.choices[0].finish_reason == "tool_calls", reply
    jsonschema.validate(json.loads(calls[0].function.arguments), schema)


def test_a_tiny_random_qwen2_calls_valid_tools(tmp_path, smollm2_tokenizer):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from octavo import LLM

    config = Qwen2Config(
        vocab_size=len(smollm2_tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    smollm2_tokenizer.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), device="cpu", num_kv_blocks=64, max_model_len=1024)
    with ServerThread(build_app(llm.engine, "q", chat_template=TEMPLATE)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(
            model="q", messages=QUESTION, tools=[WEATHER, TIME], tool_choice="required",
            parallel_tool_calls=False, temperature=0.8, seed=1, max_tokens=200,
        )  # fmt: skip
    (call,) = reply.choices[0].message.tool_calls
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema["function"]["parameters"])


def test_llm_chat_renders_tools_and_template_variables(llm_factory):
    llm = llm_factory(quantization="auto")
    from octavo import SamplingParams

    template = TEMPLATE + "{%- if flavour is defined %}{{ flavour }}{% endif %}"
    (out,) = llm.chat(
        QUESTION, SamplingParams(max_tokens=1), use_tqdm=False, tools=[WEATHER],
        chat_template=template, chat_template_kwargs={"flavour": "vanilla"},
    )  # fmt: skip
    prompt = llm.get_tokenizer().decode(out.prompt_token_ids)
    assert '"name": "get_weather"' in prompt and prompt.endswith("vanilla")
    with pytest.raises(ValueError, match="rejected the conversation"):
        llm.chat(QUESTION, use_tqdm=False, chat_template_kwargs={"messages": []})


def test_serve_reads_its_chat_template_file_or_says_why_not(tmp_path):
    from octavo.entrypoints.openai.cli_serve import _chat_template

    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert _chat_template(str(path)) == TEMPLATE
    assert _chat_template(None) is None
    with pytest.raises(SystemExit, match="--chat-template .*nope.jinja: No such file"):
        _chat_template(str(tmp_path / "nope.jinja"))
