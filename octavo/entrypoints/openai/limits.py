"""The server's limits on what a request may hold, checked before any costly work (reading a
huge body, tokenizing a huge prompt, compiling a huge schema), and the short form of the
errors a grammar compiler gives. Plain Python: the CLI imports it without a web framework.

Each check raises ValueError with a message for the client; the caller names the field."""

from __future__ import annotations

import json
import re
from typing import Any

DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # far above the text any model's context can hold
# A token is rarely more than a few characters of text; a prompt this many times longer than
# the context cannot fit it, so it is refused before the tokenizer spends time on it.
MAX_CHARS_PER_TOKEN = 16
MAX_SCHEMA_DEPTH = 64  # JSON schemas in use nest a few levels; llguidance recurses on them
MAX_CONSTRAINT_CHARS = 128 << 10  # a JSON schema's text, a regex, a grammar, or the choices
MAX_ERROR_DETAIL_CHARS = 200  # of a compiler's message, which may quote the whole grammar
# Parsing and validating a body holds the GIL, and its cost is per JSON array, object and
# member far more than per byte: a body of this many stays within tens of milliseconds.
MAX_JSON_ITEMS = 16384
MAX_JSON_DEPTH = 256  # arrays and objects within one another (Python's parser recurses)
# And values (commas): enough for a prompt of token ids as long as any context served, twice
# over (Llama 3.1's is 131,072 tokens).
MAX_JSON_ARRAY_VALUES = 262144
MAX_PROMPTS = 2048  # a completion request's prompts, each an engine request
# Requests whose bodies are parsed, validated and prepared for the engine at once. A burst of
# hundreds would otherwise resume together after each thread hop, in one event-loop iteration
# that /health waits behind; the work is bound by the GIL anyway, so a few at a time keep up.
MAX_ADMITTING = 8

_TOKEN_ID = re.compile(r"-?[0-9]+")  # ASCII digits only; fullmatch, so no trailing newline
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"')  # a JSON string
# A JSON string, or outside one an array's or object's opening or an object member's colon
# (group 1), or a comma (group 2).
_STRING_OR_ITEM = re.compile(_STRING.pattern + rb"|([\[{:])|(,)")


def check_json_items(body: bytes) -> None:
    """ValueError for a body with more than MAX_JSON_ITEMS arrays, objects and object
    members, or more than MAX_JSON_ARRAY_VALUES commas (array values, members). Counting the
    brackets, colons and commas is enough for most bodies; a body with more of them, inside
    its strings perhaps, is counted exactly: by taking its strings' own off the totals when
    it has fewer quotes than commas, else by a Python loop over every item (call this on a
    thread: the loops let the event loop take the GIL)."""
    items = body.count(b"[") + body.count(b"{") + body.count(b":")
    commas = body.count(b",")
    if items <= MAX_JSON_ITEMS and commas <= MAX_JSON_ARRAY_VALUES:
        return
    if body.count(b'"') < commas:  # e.g. a long array of token ids
        for match in _STRING.finditer(body):
            text = match.group()
            items -= text.count(b"[") + text.count(b"{") + text.count(b":")
            commas -= text.count(b",")
    else:
        items = commas = 0
        for match in _STRING_OR_ITEM.finditer(body):
            items += match.lastindex == 1
            commas += match.lastindex == 2
            if items > MAX_JSON_ITEMS or commas > MAX_JSON_ARRAY_VALUES:
                break
    if items > MAX_JSON_ITEMS or commas > MAX_JSON_ARRAY_VALUES:
        raise ValueError(
            f"the request body has more than {MAX_JSON_ITEMS} JSON arrays, objects and "
            f"object members or {MAX_JSON_ARRAY_VALUES} values, this server's limit"
        )


JSON_TOO_DEEP = (
    f"the request body nests JSON arrays and objects more than {MAX_JSON_DEPTH} deep, this "
    "server's limit"
)
_SCHEMA_TOO_DEEP = (
    f"the JSON schema nests deeper than this server's limit of {MAX_SCHEMA_DEPTH} levels"
)


def check_json_depth(value: object) -> None:
    """ValueError for a JSON value that nests arrays and objects more than MAX_JSON_DEPTH
    deep (the items are bounded by check_json_items)."""
    if json_depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise ValueError(JSON_TOO_DEEP)


def check_num_prompts(num_prompts: int) -> None:
    """ValueError for more prompts in one completion request than MAX_PROMPTS."""
    if num_prompts > MAX_PROMPTS:
        raise ValueError(
            f"`prompt` holds {num_prompts} prompts, more than this server's limit of "
            f"{MAX_PROMPTS} a request"
        )


def check_prompt_chars(num_chars: int, max_model_len: int) -> None:
    """ValueError for a text prompt too long to fit the context whatever its tokens."""
    limit = MAX_CHARS_PER_TOKEN * max_model_len
    if num_chars > limit:
        raise ValueError(
            f"the prompt has {num_chars} characters, more than the {limit} this server "
            f"tokenizes for a context of {max_model_len} tokens"
        )


def parse_token_id(key: str) -> int | None:
    """A logit_bias key as a token id: decimal ASCII digits with an optional minus and
    nothing around them (no spaces, underscores or other scripts' digits); else None."""
    if len(key) > 20 or not _TOKEN_ID.fullmatch(key):
        return None
    return int(key)


def check_constraint(spec: dict[str, Any]) -> None:
    """ValueError for a structured-output constraint (StructuredOutputsParams' fields) over
    the limits: a JSON schema nested deeper than MAX_SCHEMA_DEPTH, or any constraint's text
    longer than MAX_CONSTRAINT_CHARS. A schema that is not JSON is left to the compiler."""
    schema = spec.get("json")
    if isinstance(schema, str):
        _check_size("json", len(schema))
        try:
            schema = json.loads(schema)
        except RecursionError:
            raise ValueError(_SCHEMA_TOO_DEEP) from None
        except ValueError:
            return
    if isinstance(schema, (dict, list)):
        if json_depth(schema) > MAX_SCHEMA_DEPTH:
            raise ValueError(_SCHEMA_TOO_DEEP)
        _check_size("json", len(json.dumps(schema)))
    for name in ("regex", "grammar"):
        if isinstance(spec.get(name), str):
            _check_size(name, len(spec[name]))
    choice = spec.get("choice")
    if isinstance(choice, list):
        _check_size("choice", sum(len(c) for c in choice if isinstance(c, str)))


def json_depth(value: Any, limit: int = MAX_SCHEMA_DEPTH) -> int:
    """How deep dicts and lists nest in `value` ({} is 1), level by level without recursion;
    stops counting past `limit`."""
    depth, level = 0, [value] if isinstance(value, (dict, list)) else []
    while level and depth <= limit:
        depth += 1
        children = (c for v in level for c in (v.values() if isinstance(v, dict) else v))
        level = [c for c in children if isinstance(c, (dict, list))]
    return depth


def short_detail(message: str) -> str:
    """A compiler's error cut to its first line and MAX_ERROR_DETAIL_CHARS: enough to name
    the problem without echoing the grammar or the parser's state."""
    first = message.strip().split("\n", 1)[0]
    if len(first) > MAX_ERROR_DETAIL_CHARS:
        return first[:MAX_ERROR_DETAIL_CHARS] + "..."
    return first


def _check_size(name: str, num_chars: int) -> None:
    if num_chars > MAX_CONSTRAINT_CHARS:
        raise ValueError(
            f"the {name} constraint has {num_chars} characters, more than this server's "
            f"limit of {MAX_CONSTRAINT_CHARS}"
        )
