"""Where a sequence stops: the one place that decides it, from its newest token and text.

    EOS / stop token id / max_tokens / context limit      check_tokens(requests)
    structured output's grammar complete, or refused        (feeds the grammars the tokens)
    whether the newest text is searched for stop strings  searches_text(request, status)
    stop string in the newest text                        check_text(request, status, stop)

The engine asks them for every sequence that got a token, then finishes it with the status
decided. Beam search asks `token_status` of each candidate token, the scheduler
`finishes_at` only to skip a step whose token could not be used. The model's EOS ids live
here; the engine hands them on from here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from octavo.core.request import GrammarState, Request, RequestStatus

AcceptTokens = Callable[[list[GrammarState], list[int]], list[bool]]


def accept_each(grammars: list[GrammarState], tokens: list[int]) -> list[bool]:
    """Grammar i takes tokens[i]; whether each accepted it."""
    return [g.accept(t) for g, t in zip(grammars, tokens, strict=True)]


class StopChecker:
    """The stop rules of one model: its EOS ids and context limit, and each request's
    params."""

    def __init__(
        self,
        eos_token_ids: Iterable[int],
        max_model_len: int,
        accept_tokens: AcceptTokens = accept_each,
    ) -> None:
        """`accept_tokens` feeds grammars their tokens (the engine's runs many at once)."""
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))  # each once, in order
        self.max_model_len = max_model_len
        self.accept_tokens = accept_tokens

    def finishes_at(self, request: Request, num_tokens: int) -> bool:
        """True if the request surely finishes once it has `num_tokens` tokens (max_tokens
        or the context limit)."""
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None and num_tokens - len(request.prompt_token_ids) >= max_tokens:
            return True
        return num_tokens >= self.max_model_len

    def check_tokens(self, requests: list[Request]) -> list[RequestStatus | None]:
        """The status each request's newest token gives it (None: it runs on): the token
        rules (`check`), then, for a structured output that passed them, its grammar, which
        takes the token (`check_grammar`)."""
        statuses = [self.check(request) for request in requests]
        constrained = [
            i for i, r in enumerate(requests) if statuses[i] is None and r.grammar is not None
        ]
        if constrained:
            grammars = [requests[i].grammar for i in constrained]
            tokens = [requests[i].output_token_ids[-1] for i in constrained]
            for i, ok in zip(constrained, self.accept_tokens(grammars, tokens), strict=True):
                statuses[i] = self.check_grammar(requests[i], ok)
        return statuses

    def check(self, request: Request) -> RequestStatus | None:
        """`token_status` of the request's newest token; a stop id is recorded as its
        `stop_reason`."""
        params = request.sampling_params
        status, stop_id = self.token_status(
            request.output_token_ids[-1], len(request.output_token_ids),
            request.num_prompt_tokens, ignore_eos=params.ignore_eos,
            max_tokens=params.max_tokens, min_tokens=params.min_tokens,
            stop_token_ids=params.stop_token_ids,
        )  # fmt: skip
        if stop_id is not None:
            request.stop_reason = stop_id
        return status

    def token_status(
        self,
        token: int,
        num_output: int,
        num_prompt: int,
        *,
        ignore_eos: bool,
        max_tokens: int | None,
        min_tokens: int = 0,
        stop_token_ids: Iterable[int] = (),
    ) -> tuple[RequestStatus | None, int | None]:
        """What `token`, the `num_output`-th output token after a prompt of `num_prompt`,
        does to its sequence (None: it runs on), and the stop id that matched (or None):
        from min_tokens on, an EOS id (unless ignore_eos) or a stop id stops it; then
        max_tokens or the context limit ends it."""
        if num_output >= min_tokens:
            if not ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, None
            if token in stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token
        if (max_tokens is not None and num_output >= max_tokens) or (
            num_prompt + num_output >= self.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH, None
        return None, None

    @staticmethod
    def searches_text(request: Request, status: RequestStatus | None) -> bool:
        """Whether the newest token's text is searched for stop strings: not when an EOS or a
        stop id stopped the request (its text stays out of the output, as in vLLM, unless
        include_stop_str_in_output; a completed grammar is not such a stop), and not for a
        token its grammar refused (the text keeps to the constraint)."""
        if status is RequestStatus.FINISHED_ABORTED:
            return False
        stopped_by_token = status is RequestStatus.FINISHED_STOPPED and not (
            request.grammar is not None and request.grammar.is_complete
        )
        return not stopped_by_token or request.sampling_params.include_stop_str_in_output

    @staticmethod
    def check_grammar(request: Request, accepted: bool) -> RequestStatus | None:
        """A structured output stops once its grammar is complete (only EOS could follow);
        a token the grammar refused aborts it (the sampler's mask allowed only tokens it
        takes, so that is a bug, logged by the grammar)."""
        if not accepted:
            return RequestStatus.FINISHED_ABORTED
        if request.grammar is not None and request.grammar.is_complete:
            return RequestStatus.FINISHED_STOPPED
        return None

    @staticmethod
    def check_text(
        request: Request, status: RequestStatus | None, stop: str | None
    ) -> RequestStatus | None:
        """The final status, given the token rules' `status` and the stop string `stop` that
        the newest text completed (None if none). A stop string also ends a request that
        reached its length with that token (the text was cut there, as vLLM reports it);
        a token that stopped it otherwise keeps its reason, except a completed grammar,
        whose stop string is named."""
        if stop is None:
            return status
        if status is None or status is RequestStatus.FINISHED_LENGTH:
            request.stop_reason = stop
            return RequestStatus.FINISHED_STOPPED
        if request.grammar is not None and request.grammar.is_complete:
            request.stop_reason = stop
        return status
