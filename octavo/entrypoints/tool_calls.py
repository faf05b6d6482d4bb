"""Tool calls in chat: the formats models write them in, the grammars that make a call parse,
and the parsing of a reply, whole or streamed, into content and calls.

A format says how one call is written and how calls follow each other:

    hermes       <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (Qwen2.5, Qwen3)
    llama3_json  {"name": "f", "parameters": {...}}; {...}                      (Llama 3.1, 3.2)
    mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]

With tool_choice "required" or a named function the reply is held to a grammar of the calls
(llguidance's lark, each call's arguments its function's JSON schema); with "auto" the grammar
starts only once the model writes the format's opening (a lazy trigger), so free text stays
free and a call, once opened, completes valid.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")


class ToolError(ValueError):
    """A request's tools or tool_choice are wrong; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")


@dataclass(frozen=True)
class Function:
    name: str
    parameters: dict


def check_tools(tools: object) -> list[Function]:
    """OpenAI's `tools` ([{"type": "function", "function": {"name", "description",
    "parameters"}}]) as Functions; ToolError naming the entry for anything else."""
    if not isinstance(tools, list) or not tools:
        raise ToolError("`tools` must be a non-empty list", "tools")
    functions: list[Function] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ToolError(f'{where} must be {{"type": "function", "function": {{...}}}}', "tools")
        spec = tool.get("function")
        if not isinstance(spec, dict):
            raise ToolError(f"{where}.function must be an object", "tools")
        name = spec.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ToolError(
                f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-'", "tools"
            )
        parameters = spec.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise ToolError(f"{where}.function.parameters must be a JSON Schema object", "tools")
        if any(f.name == name for f in functions):
            raise ToolError(f"{where}.function.name {name!r} is given twice", "tools")
        functions.append(Function(name, parameters))
    return functions


def resolve_tool_choice(
    tool_choice: object, functions: list[Function] | None
) -> tuple[str, str | None]:
    """("none" | "auto" | "required", the named function or None); ToolError for a choice
    without tools or a function not among them. Default: "auto" with tools, else "none"."""
    if tool_choice is None:
        return ("auto" if functions else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ToolError(
                f'`tool_choice` must be "none", "auto", "required" or a named function, '
                f"got {tool_choice!r}", "tool_choice",
            )  # fmt: skip
        if tool_choice != "none" and not functions:
            raise ToolError(f'`tool_choice` "{tool_choice}" needs `tools`', "tool_choice")
        return tool_choice, None
    name = None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
    if not isinstance(name, str):
        raise ToolError(
            '`tool_choice` must be {"type": "function", "function": {"name": ...}}', "tool_choice"
        )
    if not functions:
        raise ToolError("a named `tool_choice` needs `tools`", "tool_choice")
    if all(f.name != name for f in functions):
        raise ToolError(f"`tool_choice` names {name!r}, which is not in `tools`", "tool_choice")
    return "required", name


# ---- formats -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes its calls: `opening` starts the calls (the lazy trigger of "auto";
    "" where a reply that is calls starts with the first call), then each call
    `call_open` + `body_prefix(name)` + arguments + "}" + `call_close`, `separator` between
    two, and `closing` after the last."""

    name: str
    opening: str
    call_open: str  # before {"name": ... of each call
    call_close: str  # after each call's object
    separator: str
    closing: str
    args_key: str = "arguments"

    def body_prefix(self, name: str) -> str:
        return f'{{"name": {json.dumps(name)}, "{self.args_key}": '

    def write(self, calls: list[tuple[str, str]]) -> str:
        """The text of these (name, arguments JSON) calls, as the grammar has them written."""
        parts = [self.call_open + self.body_prefix(n) + a + "}" + self.call_close for n, a in calls]
        return self.opening + self.separator.join(parts) + self.closing


HERMES = ToolFormat("hermes", "", "<tool_call>\n", "\n</tool_call>", "\n", "")
LLAMA3_JSON = ToolFormat("llama3_json", "", "", "", "; ", "", args_key="parameters")
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS][", "", "", ", ", "]")
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}


def pick_format(parser: str, chat_template: str | None) -> ToolFormat:
    """The --tool-call-parser's format; "auto" reads the chat template: Mistral's
    [TOOL_CALLS], Llama 3's ipython role, else hermes' <tool_call> (Qwen's and the most
    common)."""
    if parser != "auto":
        return FORMATS[parser]
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "ipython" in template or "<|python_tag|>" in template:
        return LLAMA3_JSON
    return HERMES


def trigger_of(fmt: ToolFormat) -> str:
    return fmt.opening or fmt.call_open


_COMPACT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def tool_grammar(
    fmt: ToolFormat, functions: list[Function], choice: str, name: str | None, parallel: bool
) -> str:
    """The lark grammar (llguidance's) of a reply under tool_choice `choice` ("required" or
    "auto"), `name` the one function allowed if named: the calls' names fixed, each one's
    arguments its JSON schema."""

    def lit(text: str) -> str:
        return json.dumps(text) if text else ""

    allowed = [f for f in functions if name is None or f.name == name]
    lines = ["%llguidance {}"]
    for i, function in enumerate(allowed):
        # Arguments written compactly: a model cannot pad them with whitespace forever.
        schema = json.dumps({**function.parameters, "x-guidance": _COMPACT})
        lines.append(f'body_{i}: {lit(fmt.body_prefix(function.name))} %json {schema} "}}"')
    lines.append("body: " + " | ".join(f"body_{i}" for i in range(len(allowed))))
    lines.append(f"call: {lit(fmt.call_open)} body {lit(fmt.call_close)}")
    more = f"({lit(fmt.separator)} call)*" if parallel else ""
    trigger = trigger_of(fmt)
    if choice == "required":
        lines.append(f"start: {lit(fmt.opening)} call {more} {lit(fmt.closing)}")
    elif fmt.opening:  # free text until the model opens its calls; from there, the calls
        lines.append(f"start: TEXT | opened call {more} {lit(fmt.closing)}")
    elif trigger:  # free text until the model opens a call
        lines.append(f"start: TEXT | opened body {lit(fmt.call_close)} {more}")
    else:  # calls written bare (llama3_json): a reply that starts with "{" is calls
        lines.append(f"start: call {more} | TEXT")
        lines.append(r"TEXT: /([^{ \n](.|\n)*)?/")
    if choice != "required" and trigger:
        lines.append(f"opened[lazy]: TEXT {lit(trigger)}")
        lines.append(r"TEXT: /(.|\n)*/")
    return "\n".join(lines) + "\n"


# ---- parsing -----------------------------------------------------------------------------


def parse_tool_calls(fmt: ToolFormat, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole reply; a reply whose calls do not parse is all content
    (never an error)."""
    start = find_calls(fmt, text)
    if start < 0:
        return text, []
    calls = []
    for scan in scan_calls(fmt, text, start):
        if scan.name is None or scan.args_end is None or not scan.complete:
            return text, []
        arguments = text[scan.args_start : scan.args_end]
        try:
            json.loads(arguments)
        except json.JSONDecodeError:
            return text, []
        calls.append(ToolCall(scan.name, arguments))
    if not calls:
        return text, []
    content = text[:start].rstrip() if trigger_of(fmt) else ""  # bare calls: all of it
    return content or None, calls


def find_calls(fmt: ToolFormat, text: str) -> int:
    """Where a reply's calls start (-1: nowhere): at the format's trigger, or for calls
    written bare (llama3_json) at the first character if that opens an object (after
    <|python_tag|>)."""
    if trigger_of(fmt):
        return text.find(trigger_of(fmt))
    stripped = text.lstrip().removeprefix("<|python_tag|>").lstrip()
    return len(text) - len(stripped) if stripped.startswith("{") else -1


@dataclass
class _CallScan:
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None  # None while the arguments are incomplete
    complete: bool = False  # the call's object closed


def scan_calls(fmt: ToolFormat, text: str, start: int) -> list[_CallScan]:
    """The calls' objects after `start`, as far as the text goes: each one's name, where its
    arguments are, and whether it is complete. The glue between objects (tags, separators)
    holds no '{'."""
    calls = []
    i = start
    while True:
        i = text.find("{", i)
        if i < 0:
            return calls
        scan, i = _scan_object(fmt, text, i)
        calls.append(scan)
        if not scan.complete:
            return calls


def _scan_object(fmt: ToolFormat, text: str, i: int) -> tuple[_CallScan, int]:
    scan = _CallScan()
    i += 1
    n = len(text)
    while True:
        i = _skip(text, i, " \t\r\n,")
        if i >= n:
            return scan, n
        if text[i] == "}":
            scan.complete = True
            return scan, i + 1
        key_end = _value_end(text, i)
        if text[i] != '"' or key_end is None:
            return scan, n
        key = _string(text[i:key_end])
        if key is None:  # not valid JSON (a raw control character): not a call
            return scan, n
        i = _skip(text, key_end, " \t\r\n")
        if i >= n or text[i] != ":":
            return scan, n
        i = _skip(text, i + 1, " \t\r\n")
        end = _value_end(text, i)
        if key in (fmt.args_key, "arguments", "parameters"):
            scan.args_start, scan.args_end = i, end
        elif key == "name" and end is not None and text[i] == '"':
            scan.name = _string(text[i:end])
        if end is None:
            return scan, n
        i = end


def _string(quoted: str) -> str | None:
    try:
        return json.loads(quoted)
    except json.JSONDecodeError:
        return None


def _skip(text: str, i: int, chars: str) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def _value_end(text: str, i: int) -> int | None:
    """The end of the JSON value starting at text[i], None if the text ends before it."""
    n = len(text)
    if i >= n:
        return None
    if text[i] in '"{[':  # a string, or an array or object (whose strings may hold brackets)
        depth, j, in_string = 0, i, False
        while j < n:
            c = text[j]
            if in_string:
                if c == "\\":
                    j += 1
                elif c == '"':
                    in_string = False
                    if depth == 0:
                        return j + 1
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < n and text[j] not in ",}] \t\r\n":
        j += 1
    return j if j < n else None
