"""Sequences driven from outside the engine's own sampling: beam search reports each
sequence's next-token log-probs, picks the tokens and forks and finishes sequences itself
(engine/beam_search.py). A part of `Engine`."""

from __future__ import annotations

from octavo.core.request import Request, RequestStatus
from octavo.runner.outputs import TokenLogprobs


class DrivenSequences:
    """Engine's methods for a caller that picks the tokens (`self` is the Engine)."""

    def report_step(self) -> dict[str, TokenLogprobs] | None:
        """Runs one step in which each sequence that reaches its last token reports the
        log-probs of its next token (the sampled one, then its params' top `logprobs`) and
        takes none: the caller picks tokens (`append_token`). None if nothing could be
        scheduled. Synchronous: not for use while step() has a step in flight."""
        so = self.scheduler.schedule()
        if so.is_empty:
            return None
        try:
            result = self.runner.execute(so)
        except Exception:
            self.scheduler.drop_step(so)
            raise
        self.scheduler.update(so, {})  # advances num_computed_tokens, appends nothing
        self.stats.num_steps += 1
        self.stats.num_tokens_computed += so.num_batched_tokens
        reports = {}
        for item in so.scheduled:
            entries = result.logprobs.get(item.request_id)
            if item.sample and entries:
                reports[item.request_id] = entries[0]
        return reports

    def fork_sequence(self, parent: Request, child_id: str) -> Request:
        """A new sequence with the parent's tokens, sharing its KV blocks (copy-on-write)."""
        return self.scheduler.fork_request(parent, child_id)

    @staticmethod
    def append_token(request: Request, token_id: int) -> None:
        """Gives a sequence its next token (picked by the caller from its report)."""
        request.append_output_token(token_id)

    def finish_sequence(self, request: Request) -> None:
        """Finishes a sequence and frees its KV blocks; its tokens stay readable."""
        self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
