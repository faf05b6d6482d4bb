"""RequestOutput, CompletionOutput and Logprob cross `octavo serve`'s pipe pickled through
their own `__reduce__`: every field, set to something other than its default, comes back."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

from octavo.outputs import CompletionOutput, Logprob, RequestOutput


def every_field_set(cls):
    """An instance whose fields all differ from their defaults (and from each other)."""
    values = {
        "logprob": -0.5, "rank": 3, "decoded_token": " a",
        "index": 2, "text": "hi", "token_ids": [5, 6], "cumulative_logprob": -1.25,
        "logprobs": [{5: Logprob(-0.1, 1, "h")}], "finish_reason": "stop", "stop_reason": "!",
        "request_id": "r-1", "prompt": "p", "prompt_token_ids": [1, 2, 3],
        "outputs": [CompletionOutput(1, "x", [9], finish_reason="length")], "finished": True,
        "num_cached_tokens": 16, "prompt_logprobs": [None, {2: Logprob(-2.0, 4, "q")}],
    }  # fmt: skip
    names = [f.name for f in dataclasses.fields(cls)]
    missing = [n for n in names if n not in values]
    assert not missing, f"give the new fields of {cls.__name__} a value here: {missing}"
    return cls(**{n: values[n] for n in names})


@pytest.mark.parametrize("cls", [Logprob, CompletionOutput, RequestOutput])
def test_pickle_and_copies_keep_every_field(cls):
    original = every_field_set(cls)
    assert pickle.loads(pickle.dumps(original, pickle.HIGHEST_PROTOCOL)) == original
    assert copy.deepcopy(original) == original
    shallow = copy.copy(original)
    assert shallow == original and shallow is not original


def test_the_field_order_that_positional_calls_rely_on():
    """OutputProcessor.make_output and _delta build these positionally (and __reduce__
    lists them in order): a field added or moved must be added or moved there too."""
    assert [f.name for f in dataclasses.fields(RequestOutput)] == [
        "request_id", "prompt", "prompt_token_ids", "outputs", "finished", "num_cached_tokens",
        "prompt_logprobs",
    ]  # fmt: skip
    assert [f.name for f in dataclasses.fields(CompletionOutput)] == [
        "index", "text", "token_ids", "cumulative_logprob", "logprobs", "finish_reason",
        "stop_reason",
    ]  # fmt: skip
