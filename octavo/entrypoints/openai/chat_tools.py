"""Tools and reasoning in chat completions: what a request's `tools` and `tool_choice` add to
its prompt and its constraint, and how a reply, whole or streamed, splits into reasoning,
content and tool calls (octavo/entrypoints/tool_calls.py, reasoning.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from octavo.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCallItem,
)
from octavo.entrypoints.openai.serving import ChatOptions, OpenAIError
from octavo.entrypoints.reasoning import (
    ReasoningFormat,
    ReasoningStream,
    after_reasoning,
    pick_reasoning,
    split_reasoning,
)
from octavo.entrypoints.tool_call_stream import ToolCallStream
from octavo.entrypoints.tool_calls import (
    Function,
    ToolError,
    ToolFormat,
    check_tools,
    parse_tool_calls,
    pick_format,
    resolve_tool_choice,
    tool_grammar,
)
from octavo.sampling_params import StructuredOutputsParams


@dataclass
class ReplyPlan:
    """How one request's replies are read: its tool-call format (None: no tools, or
    tool_choice "none"), its reasoning format (None: no reasoning parser), the tools for the
    template, and the checked functions with the choice among them."""

    tools: list[dict] | None = None
    tool_format: ToolFormat | None = None
    reasoning: ReasoningFormat | None = None
    template_kwargs: dict = field(default_factory=dict)
    functions: list[Function] = field(default_factory=list)
    choice: str = "none"
    named: str | None = None


def plan_reply(options: ChatOptions, req: ChatCompletionRequest, template: str | None) -> ReplyPlan:
    """The request's tools checked (a 400 naming the field), the formats picked."""
    try:
        functions = check_tools(req.tools) if req.tools is not None else None
        choice, named = resolve_tool_choice(req.tool_choice, functions)
    except ToolError as e:
        raise OpenAIError(str(e), param=e.param) from None
    plan = ReplyPlan(
        reasoning=pick_reasoning(options.reasoning_parser, template),
        template_kwargs=dict(req.chat_template_kwargs or {}),
    )
    if functions is None:
        return plan
    if "tools" not in (template or ""):
        raise OpenAIError(
            "this model's chat template does not take `tools` (pass one that does with "
            "--chat-template)", param="tools",
        )  # fmt: skip
    plan.tools, plan.functions, plan.choice, plan.named = req.tools, functions, choice, named
    if choice != "none":
        plan.tool_format = pick_format(options.tool_call_parser, template)
    return plan


def constraint(
    plan: ReplyPlan, req: ChatCompletionRequest, given: StructuredOutputsParams | None
) -> StructuredOutputsParams | None:
    """The reply's constraint: the tool-call grammar under tool_choice "required", a named
    function or "auto", or the request's own structured output; after the reasoning when a
    reasoning parser reads the replies."""
    lark = None
    if plan.tool_format is not None:
        if given is not None:
            raise OpenAIError(
                "a structured output (`response_format`) and tool calls exclude each other: "
                'set `tool_choice` to "none"', param="tool_choice",
            )  # fmt: skip
        parallel = req.parallel_tool_calls and plan.named is None  # a named function: one call
        lark = tool_grammar(plan.tool_format, plan.functions, plan.choice, plan.named, parallel)
    elif given is not None and plan.reasoning is not None:
        lark = _as_lark(given)
    if lark is None:
        return given
    if plan.reasoning is not None:
        lark = after_reasoning(plan.reasoning, lark)
    return StructuredOutputsParams(grammar=lark)


def _as_lark(given: StructuredOutputsParams) -> str:
    """A structured output as a lark grammar, to follow the reasoning."""
    if given.json is not None or given.json_object:
        schema = {"type": "object"} if given.json_object else given.json
        if isinstance(schema, str):
            schema = json.loads(schema)
        return f"start: %json {json.dumps(schema)}\n"
    if given.choice is not None:
        return "start: " + " | ".join(json.dumps(c) for c in given.choice) + "\n"
    if given.regex is not None:
        import llguidance

        return llguidance.regex_to_lark(given.regex)
    raise OpenAIError(
        "a grammar constraint cannot follow a reasoning parser's reasoning",
        param="structured_outputs",
    )


# ---- replies -----------------------------------------------------------------------------


def read_reply(plan: ReplyPlan, text: str) -> AssistantMessage:
    """A whole reply split into reasoning, content and tool calls."""
    reasoning, answer = None, text
    if plan.reasoning is not None:
        reasoning, answer = split_reasoning(plan.reasoning, text)
    calls = []
    if plan.tool_format is not None and answer:
        answer, calls = parse_tool_calls(plan.tool_format, answer)
    items = [
        ToolCallItem(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in calls
    ]
    return AssistantMessage(content=answer, reasoning_content=reasoning, tool_calls=items)


class ReplyStream:
    """One choice's streamed reply: each new piece of text in, the delta's reasoning,
    content and tool-call pieces out (as a chunk's DeltaMessage)."""

    def __init__(self, plan: ReplyPlan) -> None:
        self.reasoning = ReasoningStream(plan.reasoning) if plan.reasoning else None
        self.tools = ToolCallStream(plan.tool_format) if plan.tool_format else None
        self.made_calls = False

    def feed(self, text: str, finished: bool) -> DeltaMessage:
        reasoning, answer = "", text
        if self.reasoning is not None:
            reasoning, answer = self.reasoning.feed(text, finished)
        pieces: list[DeltaToolCall] = []
        if self.tools is not None:
            answer, calls = self.tools.feed(answer, finished)
            for c in calls:
                function = DeltaFunctionCall(name=c.name, arguments=c.arguments)
                pieces.append(DeltaToolCall(index=c.index, id=c.id, function=function))
            self.made_calls = self.made_calls or bool(pieces)
        return DeltaMessage(
            content=answer or None if reasoning or pieces else answer,
            reasoning_content=reasoning or None,
            tool_calls=pieces or None,
        )
