"""Tool calls and reasoning without a model: each format's replies parsed whole and streamed
(recorded texts, malformed ones too), the checks of tools and tool_choice, and the grammars
(which texts they take) over the embedded model's tokenizer."""

from __future__ import annotations

import json

import pytest

from octavo.entrypoints.reasoning import (
    DEEPSEEK_R1,
    QWEN3,
    ReasoningStream,
    after_reasoning,
    pick_reasoning,
    split_reasoning,
)
from octavo.entrypoints.tool_call_stream import ToolCallStream
from octavo.entrypoints.tool_calls import (
    FORMATS,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    ToolError,
    check_tools,
    parse_tool_calls,
    pick_format,
    resolve_tool_choice,
    tool_grammar,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
CALLS = [("get_weather", '{"city": "Paris", "unit": "C"}'), ("get_time", '{"tz": "a}\\"b"}')]

# Recorded replies: (format, text, content, calls)
RECORDED = [
    (HERMES, HERMES.write(CALLS[:1]), None, CALLS[:1]),
    (HERMES, "Let me look.\n" + HERMES.write(CALLS), "Let me look.", CALLS),
    (HERMES, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', None,
     [("get_time", "{}")]),
    (HERMES, "No tools needed: 4.", "No tools needed: 4.", []),
    (LLAMA3_JSON, LLAMA3_JSON.write(CALLS), None, CALLS),
    (LLAMA3_JSON, '<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}', None,
     [("get_time", '{"tz": "UTC"}')]),
    (LLAMA3_JSON, "It is sunny {probably}.", "It is sunny {probably}.", []),
    (MISTRAL, MISTRAL.write(CALLS), None, CALLS),
    (MISTRAL, "Sure. " + MISTRAL.write(CALLS[1:]), "Sure.", CALLS[1:]),
]  # fmt: skip
MALFORMED = [
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),  # cut short
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'),
    (HERMES, "<tool_call>\nnot json at all\n</tool_call>"),
    (HERMES, '<tool_call>\n{"arguments": {}}\n</tool_call>'),  # no name
    (HERMES, '<tool_call>\n{"na\nme": "f"}\n</tool_call>'),  # a raw newline in a key
    (HERMES, '<tool_call>\n{"name": "f\x01", "arguments": {}}\n</tool_call>'),  # ... in a name
    (LLAMA3_JSON, '{"name": "get_time", "parameters": {"tz": "UTC"'),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_time", "arguments": [1, 2'),
]


def _stream(fmt, text: str, step: int):
    stream = ToolCallStream(fmt)
    content, names, args = "", {}, {}
    for i in range(0, len(text), step):
        piece, calls = stream.feed(text[i : i + step], i + step >= len(text))
        content += piece
        for c in calls:
            if c.name is not None:
                assert c.index not in names, "a call's name comes once, first"
                names[c.index] = c.name
            else:
                assert c.index in names, "arguments only after the name"
            args[c.index] = args.get(c.index, "") + c.arguments
    return content or None, [(names[i], args.get(i, "")) for i in sorted(names)]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), RECORDED)
def test_recorded_replies_parse_whole_and_streamed_alike(fmt, text, content, calls):
    got_content, got_calls = parse_tool_calls(fmt, text)
    assert (got_content, [(c.name, c.arguments) for c in got_calls]) == (content, calls)
    for step in (1, 2, 5, 1000):
        assert _stream(fmt, text, step) == (content, calls)


@pytest.mark.parametrize(("fmt", "text"), MALFORMED)
def test_a_malformed_call_is_content_and_never_an_error(fmt, text):
    assert parse_tool_calls(fmt, text) == (text, [])
    for step in (1, 3, 1000):
        content, _ = _stream(fmt, text, step)
        assert content  # the rest of the text comes as content


def test_tools_and_tool_choice_are_checked():
    functions = check_tools([WEATHER, TIME])
    assert [f.name for f in functions] == ["get_weather", "get_time"]
    assert resolve_tool_choice(None, functions) == ("auto", None)
    assert resolve_tool_choice(None, None) == ("none", None)
    named = {"type": "function", "function": {"name": "get_time"}}
    assert resolve_tool_choice(named, functions) == ("required", "get_time")
    bad = [
        (lambda: check_tools([]), "tools", "non-empty list"),
        (lambda: check_tools([{"type": "retrieval"}]), "tools", "tools\\[0\\] must be"),
        (lambda: check_tools([WEATHER, WEATHER]), "tools", "given twice"),
        (lambda: check_tools([{"type": "function", "function": {"name": "a b"}}]), "tools",
         "name must be"),
        (lambda: check_tools([{"type": "function", "function": {"name": "f", "parameters": 3}}]),
         "tools", "JSON Schema object"),
        (lambda: resolve_tool_choice("required", None), "tool_choice", "needs `tools`"),
        (lambda: resolve_tool_choice("always", functions), "tool_choice", "must be"),
        (lambda: resolve_tool_choice({"type": "function", "function": {"name": "nope"}},
                                     functions), "tool_choice", "not in `tools`"),
    ]  # fmt: skip
    for call, param, message in bad:
        with pytest.raises(ToolError, match=message) as info:
            call()
        assert info.value.param == param


def test_auto_picks_the_format_from_the_chat_template():
    assert pick_format("auto", "... <tool_call> ...") is HERMES
    assert pick_format("auto", "{%- if message.role == 'ipython' %}") is LLAMA3_JSON
    assert pick_format("auto", "[TOOL_CALLS]") is MISTRAL
    assert pick_format("mistral", "<tool_call>") is MISTRAL
    assert pick_reasoning("auto", "{{ '<think>' }}") is QWEN3
    assert pick_reasoning("auto", "<｜Assistant｜><think>\\n") is DEEPSEEK_R1
    assert pick_reasoning("auto", "plain") is None
    assert pick_reasoning(None, "<think>") is None


# ---- grammars over the embedded model's tokenizer ---------------------------------------


@pytest.fixture(scope="module")
def compile_grammar(smollm2_tokenizer):
    from octavo.engine.structured_output import GrammarCompiler
    from octavo.sampling_params import StructuredOutputsParams

    compiler = GrammarCompiler(smollm2_tokenizer, len(smollm2_tokenizer), [2])

    def takes(lark: str, text: str) -> tuple[bool, bool]:
        """(every token taken, the grammar complete)"""
        grammar = compiler.compile(StructuredOutputsParams(grammar=lark))
        ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
        return all(grammar.accept(t) for t in ids), grammar.is_complete

    return takes


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_the_grammars_take_calls_and_refuse_what_breaks_them(fmt, compile_grammar):
    functions = check_tools([WEATHER, TIME])
    required = tool_grammar(fmt, functions, "required", None, parallel=True)
    auto = tool_grammar(fmt, functions, "auto", None, parallel=True)
    named = tool_grammar(fmt, functions, "required", "get_time", parallel=False)
    calls = fmt.write(CALLS)
    assert compile_grammar(required, calls)[0]
    assert compile_grammar(auto, calls)[0]
    assert compile_grammar(auto, "Just words, no call.")[0]
    assert not compile_grammar(required, "Just words")[0]
    # a call to another function, arguments off the schema, a second call where one is due
    assert not compile_grammar(named, fmt.write(CALLS[:1]))[0]
    assert not compile_grammar(required, fmt.write([("get_weather", '{"town": "Paris"}')]))[0]
    assert not compile_grammar(required, fmt.write([("get_weather", '{"city": 3}')]))[0]
    assert not compile_grammar(named, fmt.write([CALLS[1], CALLS[1]]))[0]
    if fmt is not LLAMA3_JSON:  # opened, a call must complete valid
        opened = "Sure. " + fmt.write([("get_weather", '{"city": 3}')])
        assert not compile_grammar(auto, opened)[0]


# ---- reasoning ---------------------------------------------------------------------------

REASONING = [
    (QWEN3, "<think>\nThe user wants a city.\n</think>\n\nParis.", "The user wants a city.\n",
     "Paris."),
    (QWEN3, "Paris.", None, "Paris."),  # enable_thinking false
    (QWEN3, "<think>\nStill thinking when cut", "Still thinking when cut", None),
    (QWEN3, "<think>\n\n</think>\n\n{\"n\": 1}", None, '{"n": 1}'),
    (DEEPSEEK_R1, "Hmm, 2 + 2.\n</think>\n\n4", "Hmm, 2 + 2.\n", "4"),
    (DEEPSEEK_R1, "No end in sight", "No end in sight", None),
]  # fmt: skip


@pytest.mark.parametrize(("fmt", "text", "reasoning", "answer"), REASONING)
def test_reasoning_splits_whole_and_streamed_alike(fmt, text, reasoning, answer):
    assert split_reasoning(fmt, text) == (reasoning, answer)
    for step in (1, 2, 7, 1000):
        stream, got_r, got_a = ReasoningStream(fmt), "", ""
        for i in range(0, len(text), step):
            r, a = stream.feed(text[i : i + step], i + step >= len(text))
            got_r, got_a = got_r + r, got_a + a
        assert (got_r or None, got_a or None) == (reasoning, answer)


def test_a_schema_applies_after_the_reasoning(compile_grammar):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    lark = after_reasoning(QWEN3, f"start: %json {json.dumps(schema)}\n")
    assert compile_grammar(lark, '<think>\nfree text { not json\n</think>\n\n{"n": 4}') == (
        True,
        True,
    )
    assert compile_grammar(lark, '{"n": 4}')[0]  # thinking off
    assert not compile_grammar(lark, "<think>\nok\n</think>\n\nfour")[0]
    r1 = after_reasoning(DEEPSEEK_R1, f"start: %json {json.dumps(schema)}\n")
    assert compile_grammar(r1, 'anything at all\n</think>\n{"n": 1}')[0]
