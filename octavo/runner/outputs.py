"""A step's results on their way to the host: sampled tokens, log-probs, prompt log-probs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from octavo.runner.sampler import SamplerOutput
from octavo.sampling_params import SamplingParams

# (token id, log-prob, rank) for the sampled token first, then the top-k alternatives.
TokenLogprobs = list[tuple[int, float, int]]


@dataclass
class ModelRunnerOutput:
    """Per request that sampled this step: its new tokens (one, or n at the first token of
    an n > 1 request), and their log-probs if asked for. Per request that asked for prompt
    log-probs and computed prompt positions this step: (first position p, entries of
    prompt tokens p + 1, p + 2, ...), the entries shaped as for sampled tokens."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # A draft model's guesses of each request's next tokens, for the next step to verify.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class PromptLogprobSpan:
    """Positions `first .. first + count - 1` of a request's prompt, whose logits score its
    prompt tokens `first + 1 ..`; `k` alternatives each."""

    request_id: str
    first: int
    count: int
    k: int


class PendingOutput:
    """A step's sampled tokens (and log-probs) on their way to the host: the copies are
    queued behind the step's kernels, and `result()` waits for them. The sampler's output
    comes with `attach`, once the runner's sample_tokens has run."""

    def __init__(
        self,
        rows: list[tuple[str, SamplingParams, int]],
        prompt: tuple[list[PromptLogprobSpan], tuple[torch.Tensor, ...]] | None = None,
        guesses: dict[str, list[int]] | None = None,
    ):
        self.rows = rows
        self.guesses = guesses or {}  # request id -> the speculative guesses it verifies
        # Runs on the result once it is complete (a draft model's guesses for the next step).
        self.then: Callable[[ModelRunnerOutput], None] | None = None
        self._spans, prompt_tensors = prompt or ([], ())
        self._prompt_host, self._prompt_event = _copy_to_host(prompt_tensors)
        self._host, self._event = [], None  # the sampler's output, once attached
        self._sampled = not rows

    def attach(self, out: SamplerOutput) -> None:
        """Queues the copies of the sampler's output."""
        tensors = [out.sampled_token_ids]
        if out.logprobs is not None:
            tensors += [out.logprob_token_ids, out.logprobs, out.sampled_token_ranks]
        self._host, self._event = _copy_to_host(tensors)
        self._sampled = True

    def result(self) -> ModelRunnerOutput:
        """Waits for the copies; the tokens of each request, and log-probs if asked for."""
        if not self._sampled:
            raise RuntimeError("the step's sampling waits for its grammar bitmask")
        for event in (self._prompt_event, self._event):
            if event is not None:
                event.synchronize()
        result = ModelRunnerOutput({})
        if self._spans:
            _collect_prompt_logprobs(self._spans, *self._prompt_host, result)
        if not self.rows:
            return result
        host = self._host
        tokens = host[0].tolist()
        for (request_id, _, _), token in zip(self.rows, tokens, strict=True):
            result.sampled_token_ids.setdefault(request_id, []).append(token)
        if len(host) > 1:
            _collect_logprobs(self.rows, *host[1:], result)
        for request_id, guesses in self.guesses.items():
            _keep_verified(result, request_id, guesses)
        if self.then is not None:
            self.then(result)
        return result


def _keep_verified(result: ModelRunnerOutput, request_id: str, guesses: list[int]) -> None:
    """Keeps a request's samples up to the first that differs from its guess there (the
    token the model emits in the guess's place), or all of them when every guess holds
    (the last one follows the final guess).

    Row j samples, with the request's own randomness, the token after the guesses before
    it; where the guesses so far were right, it is exactly the token decoding without
    speculation would sample there. A guess is kept when it equals that sample, with
    probability p(guess); a rejected guess's row samples from p without the guess. For a
    proposer's single guess this is the rule of arXiv 2211.17192 (accept with
    min(1, p / q), q = 1, else resample from max(p - q, 0)), and greedy and seeded
    requests emit the very tokens they would without speculation."""
    tokens = result.sampled_token_ids[request_id]
    kept = 1
    while kept <= len(guesses) and tokens[kept - 1] == guesses[kept - 1]:
        kept += 1
    del tokens[kept:]
    entries = result.logprobs.get(request_id)
    if entries is not None:
        del entries[kept:]


def _copy_to_host(tensors) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Queues copies of device tensors into host memory (pinned, without waiting, on
    CUDA); returns them and an event recorded after the copies (None off CUDA)."""
    host = []
    on_cuda = bool(tensors) and tensors[0].device.type == "cuda"
    for t in tensors:
        copy = torch.empty(t.shape, dtype=t.dtype, pin_memory=on_cuda)
        copy.copy_(t, non_blocking=on_cuda)
        host.append(copy)
    if not on_cuda:
        return host, None
    event = torch.cuda.Event()
    event.record()
    return host, event


def _collect_prompt_logprobs(
    spans: list[PromptLogprobSpan], token_ids, logprobs, ranks, result: ModelRunnerOutput
) -> None:
    token_ids, values, ranks = token_ids.tolist(), logprobs.tolist(), ranks.tolist()
    row = 0
    for span in spans:
        entries = [
            _entry(token_ids[r], values[r], ranks[r], span.k) for r in range(row, row + span.count)
        ]
        result.prompt_logprobs[span.request_id] = (span.first, entries)
        row += span.count


def _collect_logprobs(
    rows, logprob_token_ids, logprobs, sampled_ranks, result: ModelRunnerOutput
) -> None:
    token_ids, values, ranks = logprob_token_ids.tolist(), logprobs.tolist(), sampled_ranks.tolist()
    for row, (request_id, params, _) in enumerate(rows):
        k = params.logprobs
        if k is None:
            continue
        entry = _entry(token_ids[row], values[row], ranks[row], k)
        result.logprobs.setdefault(request_id, []).append(entry)


def _entry(token_ids: list[int], values: list[float], rank: int, k: int) -> TokenLogprobs:
    """One row of gather_logprobs' output as TokenLogprobs: the chosen token with its rank,
    then the top k with theirs (1..k)."""
    return [(token_ids[0], values[0], rank)] + [
        (token_ids[j], values[j], j) for j in range(1, k + 1)
    ]
