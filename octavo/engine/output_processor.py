"""From sampled tokens to what users see: text, log-probs, and one RequestOutput per prompt.

A prompt with n > 1 is a group of n sequences (see Scheduler._fork); its RequestOutput holds
one CompletionOutput per sequence, in index order, and is finished when all of them are.

The request's `output_kind` picks what an output holds: everything so far (CUMULATIVE), or
what is new since the last output (DELTA: the work is proportional to the new tokens, not to
the output's length; a sequence with nothing new is left out). FINAL_ONLY requests get
cumulative outputs, made only once they finish (Engine._finish).
"""

from __future__ import annotations

from dataclasses import dataclass

from octavo.core.request import Request, RequestStatus
from octavo.core.stop import StopChecker
from octavo.engine.detokenizer import IncrementalDetokenizer
from octavo.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from octavo.runner.outputs import TokenLogprobs
from octavo.sampling_params import RequestOutputKind


@dataclass
class _SequenceState:
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    num_tokens_sent: int = 0  # DELTA: token ids already in an output
    finish_sent: bool = False  # DELTA: the finish reason is out


class OutputProcessor:
    """Keeps each sequence's detokenizer and log-probs, and each group's members and
    prompt log-probs."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _SequenceState] = {}
        self._groups: dict[str, list[Request]] = {}
        # group id -> prompt log-probs so far ([None] for the first token), and whether a
        # DELTA output has carried them.
        self._prompt_logprobs: dict[str, PromptLogprobs] = {}
        self._prompt_logprobs_sent: set[str] = set()
        # Each token's own text, for log-prob entries: decoded once per token id, as a
        # prompt's top-k entries would otherwise decode ~80k times for 4k tokens.
        self._token_texts: dict[int, str] = {}

    def add(self, request: Request) -> None:
        """Starts tracking a sequence: a new request, or a fork of one."""
        params = request.sampling_params
        detok = None
        if self.tokenizer is not None and params.detokenize:
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params)
        wants = params.logprobs is not None
        self._states[request.request_id] = _SequenceState(
            detok, [] if wants else None, 0.0 if wants else None
        )
        self._groups.setdefault(request.group_id, []).append(request)
        if params.prompt_logprobs is not None:
            self._prompt_logprobs.setdefault(request.group_id, [None])

    def process_prompt_logprobs(
        self, request: Request, first: int, entries: list[TokenLogprobs]
    ) -> None:
        """Records the log-probs of prompt tokens first + 1, first + 2, ... (from the logits
        at positions first, first + 1, ...). Positions recomputed after a preemption, or
        by a fork, are recorded once."""
        found = self._prompt_logprobs.get(request.group_id)
        if found is None:
            return
        texts = {}
        if request.sampling_params.detokenize:
            texts = self._decode_many({t for entry in entries for t, _, _ in entry})
        for position, entry in enumerate(entries, start=first + 1):
            if position == len(found):
                found.append({t: Logprob(lp, rank, texts.get(t)) for t, lp, rank in entry})

    def _group_prompt_logprobs(
        self, group_id: str, kind: RequestOutputKind
    ) -> PromptLogprobs | None:
        """The group's prompt log-probs once all are in; a DELTA request's only once."""
        found = self._prompt_logprobs.get(group_id)
        if found is None or len(found) < self._groups[group_id][0].num_prompt_tokens:
            return None
        if kind is RequestOutputKind.DELTA:
            if group_id in self._prompt_logprobs_sent:
                return None
            self._prompt_logprobs_sent.add(group_id)
        return found

    def has_group(self, group_id: str) -> bool:
        return group_id in self._groups

    def has_sequence(self, request_id: str) -> bool:
        """True while a sequence is tracked: from add() until its group's last output."""
        return request_id in self._states

    def members(self, group_id: str) -> list[Request]:
        return list(self._groups.get(group_id, []))

    def is_finished(self, group_id: str) -> bool:
        return all(m.is_finished for m in self._groups[group_id])

    def process_token(
        self,
        request: Request,
        logprobs: list[TokenLogprobs] | None,
        status: RequestStatus | None = None,
    ) -> str | None:
        """Records a sequence's newest token. `logprobs` are the entries of the scheduled
        request's samples (n of them at a fork, else one); `status` is what the token's own
        rules decided (StopChecker). Returns a stop string the newest text completed."""
        if request.request_id not in self._states:
            self.add(request)  # a fork made this step
        state = self._states[request.request_id]
        if state.logprobs is not None and logprobs:
            entries = logprobs[request.index] if len(logprobs) > 1 else logprobs[0]
            decode = self._decode_one if request.sampling_params.detokenize else _no_text
            state.logprobs.append({t: Logprob(lp, rank, decode(t)) for t, lp, rank in entries})
            state.cumulative_logprob += entries[0][1]
        if state.detokenizer is None or not StopChecker.searches_text(request, status):
            return None
        return state.detokenizer.update([request.output_token_ids[-1]])

    def _decode_one(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _decode_many(self, token_ids: set[int]) -> dict[int, str]:
        """Decodes the tokens not decoded before, in one call; returns the texts by id
        (empty without a tokenizer)."""
        new = [t for t in token_ids if t not in self._token_texts]
        if new and self.tokenizer is not None:
            texts = self.tokenizer.batch_decode([[t] for t in new])
            self._token_texts.update(zip(new, texts, strict=True))
        return self._token_texts

    def make_output(self, group_id: str) -> RequestOutput:
        """The group's RequestOutput so far; forgets the group once it is finished."""
        # NOTE: made for every running request at every step when streaming: the common
        # group of one takes no sort and no generator.
        members = self._groups[group_id]
        if len(members) == 1:
            finished = members[0].is_finished
        else:
            members = sorted(members, key=lambda r: r.index)
            finished = all(m.is_finished for m in members)
        first = members[0]
        kind = first.sampling_params.output_kind
        delta = kind is RequestOutputKind.DELTA
        completions = [c for m in members if (c := self._completion(m, delta)) is not None]
        prompt_logprobs = None
        if group_id in self._prompt_logprobs:
            prompt_logprobs = self._group_prompt_logprobs(group_id, kind)
        # NOTE: positional (in the fields' order): keywords cost more on this hot path.
        output = RequestOutput(
            group_id, first.prompt, first.prompt_token_ids, completions, finished,
            first.num_cached_tokens, prompt_logprobs,
        )  # fmt: skip
        if finished:
            for m in members:
                self._states.pop(m.request_id, None)
            del self._groups[group_id]
            self._prompt_logprobs.pop(group_id, None)
            self._prompt_logprobs_sent.discard(group_id)
        return output

    def _completion(self, request: Request, delta: bool) -> CompletionOutput | None:
        """One sequence's output so far, or (`delta`) what is new in it since its last
        output: None if nothing is."""
        state = self._states[request.request_id]
        finished = request.is_finished
        text = ""
        if state.detokenizer is not None:
            text = state.detokenizer.get_next_output_text(finished, delta)
        token_ids, logprobs = request.output_token_ids, state.logprobs
        start, end = state.num_tokens_sent if delta else 0, len(token_ids)
        if delta:
            if start == end and not text and (state.finish_sent or not finished):
                return None
            state.num_tokens_sent, state.finish_sent = end, finished
            logprobs = None if logprobs is None else logprobs[start:end]
        return CompletionOutput(  # positional, as in make_output
            request.index, text, token_ids[start:end], state.cumulative_logprob,
            logprobs, request.status.finish_reason, request.stop_reason,
        )  # fmt: skip


def _no_text(token_id: int) -> None:
    """A log-prob entry's text (none) when the request asked for detokenize=False."""
