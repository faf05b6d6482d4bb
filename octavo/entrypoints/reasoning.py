"""Reasoning output: the thinking a model writes between <think> and </think>, apart from
its answer (`reasoning_content` in OpenAI-style chat responses, as vLLM names it).

    qwen3        the reply may open with <think>; without it (enable_thinking false) it is
                 all answer
    deepseek_r1  the chat template opens <think> in the prompt: the reply starts thinking,
                 and all of it is reasoning until </think>

A structured output or a tool-call grammar applies after the reasoning, not to it
(`after_reasoning` puts the reasoning in front of the grammar).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

REASONING_PARSERS = ("auto", "qwen3", "deepseek_r1")
START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    starts_inside: bool  # the prompt opened <think>: the reply begins in the reasoning


QWEN3 = ReasoningFormat("qwen3", starts_inside=False)
DEEPSEEK_R1 = ReasoningFormat("deepseek_r1", starts_inside=True)
_FORMATS = {f.name: f for f in (QWEN3, DEEPSEEK_R1)}


def pick_reasoning(parser: str | None, chat_template: str | None) -> ReasoningFormat | None:
    """The --reasoning-parser's format; "auto" reads the chat template: none without <think>,
    deepseek_r1 where the generation prompt itself opens it, else qwen3."""
    if parser is None or parser in _FORMATS:
        return _FORMATS.get(parser)
    template = chat_template or ""
    if START not in template:
        return None
    return DEEPSEEK_R1 if "<｜Assistant｜><think>" in template else QWEN3


def split_reasoning(fmt: ReasoningFormat, text: str) -> tuple[str | None, str | None]:
    """(reasoning, answer) of a whole reply; None for a part it does not have."""
    if not (fmt.starts_inside or text.startswith(START)):  # all answer, even after a </think>
        return None, text or None
    reasoning, _, answer = text.removeprefix(START).partition(END)  # no END: cut short
    return reasoning.lstrip("\n") or None, answer.lstrip() or None


class ReasoningStream:
    """Splits a growing reply into reasoning pieces and answer pieces, holding back text that
    may still become a tag, so that the pieces assemble to `split_reasoning`'s parts."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.text = ""
        self.state = "thinking" if fmt.starts_inside else "undecided"
        self.sent = 0  # characters of the text handed out (either part)
        self.reasoned = False  # some reasoning was handed out

    def feed(self, delta: str, finished: bool) -> tuple[str, str]:
        self.text += delta
        reasoning = answer = ""
        if self.state == "undecided":
            if self.text.startswith(START):
                self.state, self.sent = "thinking", len(START)
            elif START.startswith(self.text) and not finished:
                return "", ""
            else:
                self.state = "answering"
        if self.state == "thinking":
            end = self.text.find(END, self.sent)
            if end >= 0:
                reasoning = self.text[self.sent : end]
                self.sent = end + len(END)
                self.state = "answer_start"
            else:
                safe = len(self.text) if finished else before_partial(self.text, END)
                reasoning = self.text[self.sent : max(safe, self.sent)]
                self.sent = max(safe, self.sent)
        if self.state == "answer_start":  # the whitespace after </think> is not answer
            rest = self.text[self.sent :]
            if rest.strip() or finished:
                self.sent += len(rest) - len(rest.lstrip())
                self.state = "answering"
        if self.state == "answering":
            answer = self.text[self.sent :]
            self.sent = len(self.text)
        if not self.reasoned:  # the newlines that open the reasoning are not part of it
            reasoning = reasoning.lstrip("\n")
            self.reasoned = bool(reasoning)
        return reasoning, answer


def before_partial(text: str, tag: str) -> int:
    """The end of `text` less a suffix that could be the start of `tag` (a stream holds that
    back until the next piece tells)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return len(text) - k
    return len(text)


def after_reasoning(fmt: ReasoningFormat, lark: str) -> str:
    """A lark grammar whose `start` follows the reasoning: the reply thinks freely (qwen3:
    if it opens <think>), then the grammar applies from past </think>."""
    body = lark.replace("%llguidance {}\n", "").replace("start:", "answer:", 1)
    thought = "thought WS" if fmt.starts_inside else f"({json.dumps(START)} thought WS)?"
    return (
        "%llguidance {}\n"
        f"start: {thought} answer\n"
        f"thought[lazy]: THINK {json.dumps(END)}\n"
        "THINK: /(.|\\n)*/\n"
        "WS: /[ \\n]*/\n" + body
    )
