"""From engine outputs to OpenAI choices: what is new in each choice, and log-probs in the
completions and chat shapes.

The server asks the engine for DELTA outputs: each holds what is new since the request's last
one (several steps' worth, joined, when the client fell behind). A tracker numbers the choices
across prompts and counts their tokens for `usage`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from octavo.entrypoints.openai.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
    UsageInfo,
)
from octavo.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass
class ChoiceTracker:
    """Turns (prompt index, DELTA output) into choice deltas, each the part of one choice not
    sent yet: its CompletionOutput, numbered across prompts. Counts tokens for usage."""

    n: int
    _tokens: dict[int, int] = field(default_factory=dict)  # choice index -> tokens sent
    _finished: set[int] = field(default_factory=set)
    _prompt_tokens: dict[int, int] = field(default_factory=dict)

    def update(self, prompt_index: int, out: RequestOutput) -> list[CompletionOutput]:
        self._prompt_tokens[prompt_index] = len(out.prompt_token_ids)
        deltas = []
        for c in out.outputs:
            index = prompt_index * self.n + c.index
            if index in self._finished:
                continue
            self._tokens[index] = self._tokens.get(index, 0) + len(c.token_ids)
            if c.finish_reason is not None:
                self._finished.add(index)
            if c.text or c.token_ids or c.finish_reason:
                deltas.append(c if c.index == index else replace(c, index=index))
        return deltas

    def usage(self) -> UsageInfo:
        prompt = sum(self._prompt_tokens.values())
        completion = sum(self._tokens.values())
        return UsageInfo(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )


def _token_text(token_id: int, entry: Logprob | None) -> str:
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return f"token_id:{token_id}"


def _top(entries: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    ranked = sorted(entries.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0))
    return ranked[:k]


def completion_logprobs(
    token_ids: list[int],
    logprobs: list[dict[int, Logprob] | None],
    k: int,
    text_offset: int,
    token_text,
) -> CompletionLogprobs:
    """The legacy shape: tokens, token_logprobs, top_logprobs, text_offset. A token's
    top_logprobs hold the sampled token first, then the k most likely others (k + 1 when it
    is not among them; just the sampled token when k is 0), as vLLM and OpenAI's legacy
    API give them. An echoed prompt's first token has no entry (None): its log-prob and
    top_logprobs are null, and its text is `token_text(token_id)`."""
    result = CompletionLogprobs()
    for token_id, entries in zip(token_ids, logprobs, strict=False):
        if entries is None:
            text, logprob, top = token_text(token_id), None, None
        else:
            chosen = entries.get(token_id)
            text = _token_text(token_id, chosen)
            logprob = None if chosen is None else chosen.logprob
            ranked = [] if chosen is None else [(token_id, chosen)]
            ranked += [(t, lp) for t, lp in _top(entries, k) if t != token_id]
            top = {_token_text(t, lp): lp.logprob for t, lp in ranked[: k + 1]}
        result.tokens.append(text)
        result.token_logprobs.append(logprob)
        result.top_logprobs.append(top)
        result.text_offset.append(text_offset)
        text_offset += len(text)
    return result


def prompt_logprobs_field(found: list[dict[int, Logprob] | None] | None) -> list | None:
    """RequestOutput.prompt_logprobs in vLLM's JSON shape: per prompt token, null or
    {token id: {logprob, rank, decoded_token}}."""
    if found is None:
        return None
    return [None if entry is None else {t: vars(lp) for t, lp in entry.items()} for entry in found]


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], k: int) -> ChatLogprobs:
    """The chat shape: one entry per token with its bytes and its k most likely tokens."""

    def entry(cls, token_id: int, lp: Logprob | None, **more):
        text = _token_text(token_id, lp)
        logprob = -9999.0 if lp is None else lp.logprob
        return cls(token=text, logprob=logprob, bytes=list(text.encode("utf-8")), **more)

    content = []
    for token_id, entries in zip(token_ids, logprobs, strict=False):
        top = [entry(TopLogprob, t, lp) for t, lp in _top(entries, k)]
        content.append(entry(ChatTokenLogprob, token_id, entries.get(token_id), top_logprobs=top))
    return ChatLogprobs(content=content)
