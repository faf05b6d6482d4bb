"""From cumulative engine outputs to OpenAI choices: what is new in each choice since the last
chunk, and log-probs in the completions and chat shapes.

Engine outputs are cumulative (all text and token ids so far, maybe several steps at once when
the client fell behind), so a tracker remembers how much of each choice it has sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from octavo.entrypoints.openai.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
    UsageInfo,
)
from octavo.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass
class ChoiceDelta:
    """The part of one choice not sent yet."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None


@dataclass
class _Sent:
    text: int = 0
    tokens: int = 0
    finished: bool = False


@dataclass
class ChoiceTracker:
    """Turns (prompt index, cumulative output) into deltas; counts tokens for usage."""

    n: int
    _sent: dict[int, _Sent] = field(default_factory=dict)
    _prompt_tokens: dict[int, int] = field(default_factory=dict)

    def update(self, prompt_index: int, out: RequestOutput) -> list[ChoiceDelta]:
        self._prompt_tokens[prompt_index] = len(out.prompt_token_ids)
        deltas = []
        for c in out.outputs:
            index = prompt_index * self.n + c.index
            sent = self._sent.setdefault(index, _Sent())
            if sent.finished:
                continue
            delta = _delta(index, c, sent)
            sent.text = max(sent.text, len(c.text))
            sent.tokens = len(c.token_ids)
            sent.finished = c.finish_reason is not None
            if delta.text or delta.token_ids or delta.finish_reason:
                deltas.append(delta)
        return deltas

    def usage(self) -> UsageInfo:
        prompt = sum(self._prompt_tokens.values())
        completion = sum(s.tokens for s in self._sent.values())
        return UsageInfo(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )


def _delta(index: int, c: CompletionOutput, sent: _Sent) -> ChoiceDelta:
    num_tokens = len(c.token_ids)
    return ChoiceDelta(
        index=index,
        text=c.text[sent.text :],
        token_ids=c.token_ids[sent.tokens :],
        # NOTE: the engine may keep appending to this list; slice by our token count.
        logprobs=None if c.logprobs is None else c.logprobs[sent.tokens : num_tokens],
        finish_reason=c.finish_reason,
    )


def _token_text(token_id: int, entry: Logprob | None) -> str:
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return f"token_id:{token_id}"


def _top(entries: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    ranked = sorted(entries.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0))
    return ranked[:k]


def completion_logprobs(
    token_ids: list[int], logprobs: list[dict[int, Logprob]], k: int, text_offset: int
) -> CompletionLogprobs:
    """The legacy shape: tokens, token_logprobs, top_logprobs (k per token), text_offset."""
    result = CompletionLogprobs()
    for token_id, entries in zip(token_ids, logprobs, strict=False):
        chosen = entries.get(token_id)
        text = _token_text(token_id, chosen)
        result.tokens.append(text)
        result.token_logprobs.append(None if chosen is None else chosen.logprob)
        result.top_logprobs.append(
            {_token_text(t, lp): lp.logprob for t, lp in _top(entries, k)} if k else None
        )
        result.text_offset.append(text_offset)
        text_offset += len(text)
    return result


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], k: int) -> ChatLogprobs:
    """The chat shape: one entry per token with its bytes and its k most likely tokens."""
    content = []
    for token_id, entries in zip(token_ids, logprobs, strict=False):
        chosen = entries.get(token_id)
        text = _token_text(token_id, chosen)
        content.append(
            ChatTokenLogprob(
                token=text,
                logprob=-9999.0 if chosen is None else chosen.logprob,
                bytes=list(text.encode("utf-8")),
                top_logprobs=[
                    TopLogprob(
                        token=_token_text(t, lp),
                        logprob=lp.logprob,
                        bytes=list(_token_text(t, lp).encode("utf-8")),
                    )
                    for t, lp in _top(entries, k)
                ],
            )
        )
    return ChatLogprobs(content=content)
