"""A tool-calling reply streamed: content pieces and call pieces from its growing text, the
calls' markup never shown as content (the formats: entrypoints/tool_calls.py)."""

from __future__ import annotations

from dataclasses import dataclass

from octavo.entrypoints.reasoning import before_partial
from octavo.entrypoints.tool_calls import (
    ToolCall,
    ToolFormat,
    find_calls,
    parse_tool_calls,
    scan_calls,
    trigger_of,
)


@dataclass
class ToolCallDelta:
    """A piece of a streamed call: its name first (with its id), then its arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class ToolCallStream:
    """Turns a reply's growing text into content pieces and call pieces, never showing the
    calls' markup as content: text that could still become the opening is held back until
    it cannot. A reply whose calls turn out malformed ends as content (what the whole-reply
    parse gives) from where the calls began."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.text = ""
        self.content_sent = 0
        self.calls_start: int | None = None
        self.sent: list[tuple[str, int]] = []  # per call: its id, arguments characters sent

    def feed(self, delta: str, finished: bool) -> tuple[str, list[ToolCallDelta]]:
        """The new content and call pieces once `delta` is added to the text."""
        self.text += delta
        content, pieces = "", []
        if self.calls_start is None:
            start = find_calls(self.fmt, self.text)
            self.calls_start = start if start >= 0 else None
        end = self.calls_start if self.calls_start is not None else self._safe_end(finished)
        if self.calls_start is not None and not trigger_of(self.fmt):
            self.content_sent = max(self.content_sent, end)  # before bare calls: a tag at most
        if end > self.content_sent:
            content = self.text[self.content_sent : end]
            self.content_sent = end
        if self.calls_start is not None:
            pieces = self._call_pieces()
        ended_in_calls = finished and self.calls_start is not None
        if ended_in_calls and not parse_tool_calls(self.fmt, self.text)[1]:  # malformed: content
            content += self.text[self.content_sent :]
            self.content_sent = len(self.text)
        if self.calls_start is not None and self.content_sent == self.calls_start:
            content = content.rstrip()
        return content, pieces

    def _safe_end(self, finished: bool) -> int:
        """How much of the text is surely content."""
        if finished:
            return len(self.text)
        trigger = trigger_of(self.fmt)
        if not trigger:  # llama3_json: a reply that may still open with "{" waits
            stripped = self.text.lstrip()
            maybe = not stripped or "<|python_tag|>".startswith(stripped[:14]) or stripped[0] == "{"
            return 0 if maybe and self.content_sent == 0 else len(self.text)
        end = before_partial(self.text, trigger)
        # Whitespace before an opening is not content: held until text follows it.
        return max(len(self.text[:end].rstrip()), self.content_sent)

    def _call_pieces(self) -> list[ToolCallDelta]:
        pieces = []
        for index, scan in enumerate(scan_calls(self.fmt, self.text, self.calls_start)):
            if scan.name is None:
                break
            if index == len(self.sent):
                call_id = ToolCall(scan.name, "").id
                self.sent.append((call_id, 0))
                pieces.append(ToolCallDelta(index, call_id, scan.name))
            if scan.args_start is None:
                continue
            call_id, sent = self.sent[index]
            end = scan.args_end if scan.args_end is not None else len(self.text)
            new = self.text[scan.args_start + sent : end]
            if new:
                self.sent[index] = (call_id, sent + len(new))
                if pieces and pieces[-1].index == index and not pieces[-1].arguments:
                    pieces[-1].arguments = new
                else:
                    pieces.append(ToolCallDelta(index, arguments=new))
        return pieces
