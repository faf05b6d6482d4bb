"""Structured outputs on the embedded model: whatever the model would say, the text matches
the request's JSON schema, regex, choice or grammar, and ends where the constraint does."""

from __future__ import annotations

import json
import re

import pytest
from engine_utils import GREEDY, scheduling

from octavo import SamplingParams
from octavo.sampling_params import StructuredOutputsParams as Spec

pytest.importorskip("llguidance")

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def chat(llm, question: str) -> dict:
    from octavo.tokenizer.tokenizer import apply_chat_template

    messages = [{"role": "user", "content": question}]
    return {"prompt_token_ids": apply_chat_template(llm.get_tokenizer(), messages)}


def params(spec: Spec, **kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 40, **kwargs}, structured_outputs=spec)


def test_each_kind_of_constraint_holds_the_text_and_ends_it(llm):
    cases = [
        ("Give me a person as JSON.", Spec(json=PERSON)),
        ("Give me a person as JSON.", Spec(json=json.dumps(PERSON), disable_any_whitespace=True)),
        ("What is 2+2?", Spec(regex=r"[0-9]{1,3}")),
        ("Is the sky blue?", Spec(choice=["yes", "no", "maybe not"])),
        ("Say hi.", Spec(grammar='start: "hi " NAME "!"\nNAME: /[a-z]{1,8}/')),
    ]
    prompts = [chat(llm, q) for q, _ in cases]
    outputs = llm.generate(prompts, [params(spec) for _, spec in cases], use_tqdm=False)
    texts = [o.outputs[0].text for o in outputs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs), texts
    for text in texts[:2]:
        person = json.loads(text)
        assert set(person) == {"name", "age"} and isinstance(person["age"], int), text
    assert not re.search(r"\s", texts[1])  # no whitespace beyond the schema's
    assert re.fullmatch(r"[0-9]{1,3}", texts[2])
    assert texts[3] in ("yes", "no", "maybe not")
    assert re.fullmatch(r"hi [a-z]{1,8}!", texts[4])
    (free,) = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=16),
                           use_tqdm=False)  # fmt: skip
    with pytest.raises(json.JSONDecodeError):  # the constraint does the work
        json.loads(free.outputs[0].text)


@pytest.mark.slow  # json_object runs in the server's fast test too
def test_json_object_and_sampled_completions_are_valid_json(llm):
    """json_object; and n = 3 random samples, each with its own copy of the grammar from
    the fork on, each a person."""
    prompt = chat(llm, "Give me a person as JSON.")
    (any_object,) = llm.generate(prompt, params(Spec(json_object=True), max_tokens=60),
                                 use_tqdm=False)  # fmt: skip
    if any_object.outputs[0].finish_reason == "stop":  # else it ran out of tokens inside
        assert isinstance(json.loads(any_object.outputs[0].text), dict)
    assert any_object.outputs[0].text.startswith("{")
    sampled = params(Spec(json=PERSON), temperature=1.0, seed=3, n=3)
    (group,) = llm.generate(prompt, sampled, use_tqdm=False)
    people = [json.loads(c.text) for c in group.outputs]
    assert all(set(p) == {"name", "age"} for p in people)
    assert len({c.text for c in group.outputs}) > 1


@pytest.mark.slow
def test_async_scheduling_gives_the_same_text_and_a_plain_request_is_left_alone(
    llm, chat_prompt_ids, greedy_reference
):
    """Under async scheduling each mask waits for the token before it, so the greedy text
    is the same; a plain request batched with a constrained one gives its tokens alone."""
    prompts = [chat(llm, "Give me a person as JSON."), {"prompt_token_ids": chat_prompt_ids[3]}]
    alone = greedy_reference[3]  # "List three prime numbers." by itself
    for overlap in (False, True):
        with scheduling(llm, overlap):
            person, other = llm.generate(prompts, [params(Spec(json=PERSON)), GREEDY],
                                         use_tqdm=False)  # fmt: skip
        assert set(json.loads(person.outputs[0].text)) == {"name", "age"}
        assert other.outputs[0].token_ids == alone.outputs[0].token_ids
        if not overlap:
            first = person.outputs[0].token_ids
    assert person.outputs[0].token_ids == first


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (Spec(regex="("), "(?s)structured_outputs does not compile: .*unclosed group"),
        (Spec(json="{bad"), "structured_outputs does not compile: the JSON schema is not valid"),
        (Spec(grammar="start: undefined_rule"), "structured_outputs does not compile"),
        # Compiles, but past llguidance's lexer limits at the first mask: refused at once,
        # not in a step that would stall the others and abort it.
        (Spec(regex="x{1000}{1000}"), "structured_outputs does not compile"),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_and_the_engine_goes_on(llm, spec, match):
    prompt = chat(llm, "Hi")
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, params(spec), use_tqdm=False)
    (out,) = llm.generate(prompt, params(Spec(choice=["ok"])), use_tqdm=False)
    assert out.outputs[0].text == "ok"
    assert not llm.engine.has_unfinished_requests()


def test_the_constraint_meets_stop_strings_bans_and_min_tokens(llm):
    """A token that completes the grammar and a stop string at once reports the stop string;
    bans that leave none of the grammar's tokens give way to it (it is the hard constraint);
    a grammar complete before min_tokens still ends the text, which could go no further."""
    prompt = chat(llm, "Say hello.")
    cases = [
        params(Spec(choice=["hello"]), stop=["llo"]),
        params(Spec(choice=["yes"]), allowed_token_ids=[0, 1, 2]),
        params(Spec(regex="ab?"), min_tokens=5),
    ]
    stopped, banned, short = llm.generate([prompt] * 3, cases, use_tqdm=False)
    assert (stopped.outputs[0].text, stopped.outputs[0].stop_reason) == ("he", "llo")
    assert (banned.outputs[0].text, banned.outputs[0].finish_reason) == ("yes", "stop")
    assert short.outputs[0].text in ("a", "ab") and short.outputs[0].finish_reason == "stop"


@pytest.mark.slow
def test_preemption_and_forks_keep_each_grammar_in_step(llm, llm_factory, chat_prompt_ids):
    """A KV cache too small for the batch preempts and recomputes requests mid-text, with
    async scheduling, and n = 2 samples fork their grammars: every text is still a person,
    and the greedy ones equal those of an engine with room for all."""
    prompts = [{"prompt_token_ids": ids} for ids in chat_prompt_ids]
    greedy = [params(Spec(json=PERSON), max_tokens=32) for _ in prompts]
    sampled = params(Spec(json=PERSON), max_tokens=32, temperature=1.0, seed=5, n=2)
    reference = llm.generate(prompts, greedy, use_tqdm=False)
    small = llm_factory(num_kv_blocks=14)
    preemptions = small.get_stats()["num_preemptions"]  # the engine is shared
    with scheduling(small, True):
        outputs = small.generate(prompts, greedy, use_tqdm=False)
        assert small.get_stats()["num_preemptions"] > preemptions
        assert [o.outputs[0].token_ids for o in outputs] == [
            o.outputs[0].token_ids for o in reference
        ]
        for group in small.generate(prompts[:4], sampled, use_tqdm=False):
            for completion in group.outputs:
                if completion.finish_reason == "stop":  # else 32 tokens ran out inside it
                    assert set(json.loads(completion.text)) == {"name", "age"}
                assert completion.text.startswith("{")
    stats = small.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
