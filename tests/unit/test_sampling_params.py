"""SamplingParams: every invalid field raises a ValueError naming it; valid values normalize."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from octavo.sampling_params import MAX_N, SamplingParams, SamplingType, StructuredOutputsParams

BAD_VALUES = [
    ("n", [0, -1, MAX_N + 1, 1.5, "1", True, None]),
    ("temperature", [-0.1, -1, "1", True, None, math.nan, math.inf, 1.1e38]),  # > MAX_TEMPERATURE
    ("top_p", [0, 0.0, -0.5, 1.01, 2, "0.5", True, math.nan]),
    ("top_k", [-2, -10, 1.5, "3", True]),
    ("min_p", [-0.1, 1.1, "0.1", True, math.nan]),
    ("seed", [1.5, "1", True]),
    ("max_tokens", [0, -1, 1.5, "16", True]),
    ("min_tokens", [-1, 1.5, "2", True, None]),
    ("stop", ["", [""], ["a", ""], [1], 3, {"a"}]),
    ("stop_token_ids", [[-1], [1.5], [True], ["2"], 5, "abc"]),
    ("bad_words", ["", "  ", [""], ["a", " \t"], [1], 3, {"a"}]),
    ("include_stop_str_in_output", [1, "yes", None]),
    ("ignore_eos", [0, "no"]),
    ("skip_special_tokens", [1, None]),
    ("logprobs", [21, 100, -1, 1.5, "5", True]),
    ("presence_penalty", [2.01, -2.5, "0", True, math.inf]),
    ("frequency_penalty", [2.5, -2.01, "0", False, math.nan]),
    ("repetition_penalty", [0, 0.0, -1, "1", True, math.inf, 1e-39, 1e39]),  # float32: 0, inf
]


@pytest.mark.parametrize(
    ("field", "value"), [(f, v) for f, values in BAD_VALUES for v in values], ids=repr
)
def test_invalid_value_raises_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    assert re.match(rf"{field}\b", str(info.value)), str(info.value)


def test_min_tokens_above_max_tokens_is_refused_and_names_both():
    with pytest.raises(ValueError, match=r"^min_tokens.*max_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    assert SamplingParams(min_tokens=4, max_tokens=4).min_tokens == 4
    assert SamplingParams(min_tokens=50, max_tokens=None).min_tokens == 50


@pytest.mark.parametrize("n", [2, MAX_N])
def test_parallel_sampling_up_to_max_n_is_accepted(n):
    assert SamplingParams(n=n).n == n


def test_for_sample_gives_completion_i_n_1_and_seed_plus_i_as_vllm():
    p = SamplingParams(n=4, seed=11, top_k=5)
    children = [p.for_sample(i) for i in range(4)]
    assert all(c.n == 1 and c.top_k == 5 for c in children) and p.n == 4
    assert [c.seed for c in children] == [11, 12, 13, 14]
    assert SamplingParams(n=3).for_sample(2).seed is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0},
        {"temperature": 100},
        {"top_p": 1},
        {"top_p": 1e-6},
        {"top_k": 1},
        {"min_p": 0},
        {"min_p": 1},
        {"seed": -5},
        {"seed": 2**70},
        {"max_tokens": 1},
        {"max_tokens": None},
        {"logprobs": 0},
        {"logprobs": 20},
        {"presence_penalty": -2, "frequency_penalty": 2},
        {"repetition_penalty": 1e-3},
        {"stop": ("a", "bc"), "stop_token_ids": (0, 7)},
    ],
    ids=repr,
)
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_numeric_fields_are_coerced_to_python_types():
    p = SamplingParams(temperature=1, top_p=np.float32(0.5), top_k=np.int64(7), logprobs=np.int8(3))
    assert (p.temperature, p.top_p, p.top_k, p.logprobs) == (1.0, 0.5, 7, 3)
    assert type(p.temperature) is float and type(p.top_p) is float
    assert type(p.top_k) is int and type(p.logprobs) is int


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, None, 0.0)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (16, 0, [], [])
    assert (p.logprobs, p.seed, p.ignore_eos, p.skip_special_tokens) == (None, None, False, True)
    assert not p.has_penalties


@pytest.mark.parametrize(
    ("stop", "expected"), [(None, []), ("x", ["x"]), (["a", "b"], ["a", "b"]), (("a",), ["a"])]
)
def test_stop_becomes_a_list_of_strings(stop, expected):
    assert SamplingParams(stop=stop).stop == expected


@pytest.mark.parametrize(("ids", "expected"), [(None, []), ((3, 0), [3, 0]), ([9], [9])])
def test_stop_token_ids_becomes_a_list_of_ints(ids, expected):
    p = SamplingParams(stop_token_ids=ids)
    assert p.stop_token_ids == expected and type(p.stop_token_ids) is list


@pytest.mark.parametrize(("top_k", "expected"), [(None, None), (0, None), (-1, None), (5, 5)])
def test_top_k_off_values_normalize_to_none(top_k, expected):
    assert SamplingParams(top_k=top_k).top_k == expected


@pytest.mark.parametrize(
    ("temperature", "seed", "sampling_type"),
    [
        (0, None, SamplingType.GREEDY),
        (0.0, 7, SamplingType.GREEDY),
        (1e-6, None, SamplingType.GREEDY),
        (1e-5, None, SamplingType.RANDOM),
        (0.7, None, SamplingType.RANDOM),
        (0.7, 0, SamplingType.RANDOM_SEED),
        (2.0, 123, SamplingType.RANDOM_SEED),
    ],
)
def test_greedy_below_1e_5_else_random_or_seeded(temperature, seed, sampling_type):
    p = SamplingParams(temperature=temperature, seed=seed)
    assert p.sampling_type is sampling_type
    assert p.is_greedy == (sampling_type is SamplingType.GREEDY)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, False),
        ({"presence_penalty": 0.1}, True),
        ({"frequency_penalty": -0.1}, True),
        ({"repetition_penalty": 1.1}, True),
        ({"repetition_penalty": 1.0, "presence_penalty": 0.0}, False),
    ],
)
def test_has_penalties_only_when_a_penalty_changes_logits(kwargs, expected):
    assert SamplingParams(**kwargs).has_penalties is expected


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, True),
        ({"temperature": 0.7, "top_k": 5, "top_p": 0.9, "min_p": 0.1, "logprobs": 3}, True),
        ({"logit_bias": {1: 2.0}, "allowed_token_ids": [1, 2], "stop": ["x"]}, True),
        ({"seed": 1}, True),  # the runner renews its noise seed each step
        ({"min_tokens": 4}, False),  # EOS is banned for 1 more token
        ({"min_tokens": 3}, True),  # from here on EOS is allowed
        ({"bad_words": ["no"]}, False),
        ({"frequency_penalty": 0.5}, False),
        ({"structured_outputs": StructuredOutputsParams(regex="a+")}, True),  # mask each step
    ],
)
def test_sampling_follows_from_the_settings_alone_unless_it_reads_the_tokens_so_far(
    kwargs, expected
):
    """The runner reuses such rows' sampling metadata from step to step (here with three
    earlier outputs)."""
    assert SamplingParams(**kwargs).samples_from_settings_alone(3) is expected


def test_clone_is_deep_and_equal():
    p = SamplingParams(stop=["a"], stop_token_ids=[1, 2], top_k=3, seed=9)
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("b")
    q.stop_token_ids.append(3)
    q.top_k = 4
    assert p.stop == ["a"] and p.stop_token_ids == [1, 2] and p.top_k == 3


def test_logit_bias_takes_any_ban_and_caps_a_boost():
    """vLLM users ban a token with -inf or -1e9; a boost above 100 is refused, as it could
    overflow float32 once divided by a small temperature."""
    p = SamplingParams(logit_bias={1: float("-inf"), 2: -1e9, 3: 100, 4: -1e30, 5: -(10**400)})
    inf = float("inf")
    assert p.logit_bias == {1: -inf, 2: -1e9, 3: 100.0, 4: -inf, 5: -inf}  # bans are -inf
    with pytest.raises(ValueError, match="^temperature"):
        SamplingParams(temperature=10**400)  # an OverflowError before
    for bad in ({4: 100.5}, {4: float("inf")}, {4: float("nan")}, {4: "1"}, {"4": 1.0}):
        with pytest.raises(ValueError, match="^logit_bias"):
            SamplingParams(logit_bias=bad)


def test_stop_strings_need_detokenize():
    with pytest.raises(ValueError, match="^detokenize must be True for stop strings"):
        SamplingParams(stop=["\n"], detokenize=False)
    assert SamplingParams(stop_token_ids=[2], detokenize=False).detokenize is False
    with pytest.raises(ValueError, match="^detokenize must be a bool"):
        SamplingParams(detokenize=1)


def test_truncate_prompt_tokens_keeps_the_last_ones_as_vllm():
    assert SamplingParams(truncate_prompt_tokens=3).prompt_tokens_kept(100) == 3
    assert SamplingParams(truncate_prompt_tokens=-1).prompt_tokens_kept(4) == 4
    assert SamplingParams().prompt_tokens_kept(4) is None  # too long: the engine says so
    for bad in (0, -2, 1.5, "3"):
        with pytest.raises(ValueError, match="^truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)


def test_bad_words_encode_as_vllm_with_a_spaced_variant_where_it_differs():
    """Each word without its leading spaces; then " word" where that gives another first
    token and as many tokens (a word inside a text), as vLLM's update_from_tokenizer."""
    codes = {"cat": [1], " cat": [2], "big dog": [3, 4], " big dog": [5, 4],
             "x y": [6, 7], " x y": [8, 9, 7], "Hi": [10], " Hi": [10]}  # fmt: skip
    p = SamplingParams(bad_words=["  cat", "big dog", "x y", "Hi"])
    with pytest.raises(ValueError, match="bad_words must be encoded"):
        p.bad_words_token_ids  # noqa: B018
    assert p.needs_output_token_ids  # not encoded yet: a word may have several tokens
    p.encode_bad_words(codes.__getitem__, vocab_size=11)
    assert p.bad_words_token_ids == [[1], [2], [3, 4], [5, 4], [6, 7], [10]]
    assert p.needs_output_token_ids
    single = SamplingParams(bad_words="cat")
    single.encode_bad_words(codes.__getitem__, vocab_size=11)
    assert single.bad_words == ["cat"] and single.bad_words_token_ids == [[1], [2]]
    assert not single.needs_output_token_ids  # one token: banned whatever came before
    with pytest.raises(ValueError, match=r"bad_words encode to token id 10, outside"):
        SamplingParams(bad_words=["Hi"]).encode_bad_words(codes.__getitem__, vocab_size=10)
    with pytest.raises(ValueError, match="bad_words holds 'cat', which encodes to no tokens"):
        SamplingParams(bad_words=["cat"]).encode_bad_words(lambda text: [], vocab_size=10)
    p.validate()  # the words may have changed: the encoding goes with the old ones
    with pytest.raises(ValueError, match="bad_words must be encoded"):
        p.bad_words_token_ids  # noqa: B018
    assert SamplingParams().bad_words_token_ids == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "exactly one of json, regex, choice, grammar, json_object; got none"),
        ({"json": "{}", "regex": "a"}, "exactly one .*; got json, regex"),
        ({"json_object": False}, "got none"),
        ({"choice": []}, r"structured_outputs.choice must be a non-empty list of strings"),
        ({"choice": ["a", 1]}, "structured_outputs.choice must be"),
        ({"regex": 3}, "structured_outputs.regex must be str, got 3"),
        ({"json": 3}, "structured_outputs.json must be str or dict"),
        ({"json_object": True, "disable_any_whitespace": 1}, "disable_any_whitespace must be"),
    ],
)
def test_structured_outputs_take_exactly_one_constraint_of_its_type(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**kwargs)


def test_structured_outputs_are_checked_again_when_assigned_later():
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json_object": True})
    spec = StructuredOutputsParams(choice=("a", "b"))
    p = SamplingParams(structured_outputs=spec)
    assert spec.choice == ["a", "b"] and not p.needs_output_token_ids  # it samples late
    spec.regex = "x"  # two constraints now
    with pytest.raises(ValueError, match="exactly one"):
        p.validate()


def test_token_id_lists_are_sets_kept_in_order():
    """Repeats in stop_token_ids or allowed_token_ids say nothing; they are dropped, so that a
    long list of repeats costs the engine no more than its distinct ids."""
    params = SamplingParams(stop_token_ids=[5, 3, 5, 3] * 1000, allowed_token_ids=[9, 1, 9])
    assert params.stop_token_ids == [5, 3]
    assert params.allowed_token_ids == [9, 1]
