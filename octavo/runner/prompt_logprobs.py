"""Prompt log-probs: the log-probs of each prompt token from the logits of the position
before it, for the requests that asked for them (`SamplingParams.prompt_logprobs`)."""

from __future__ import annotations

import torch

from octavo.attention.backend import AttentionMetadata
from octavo.core.sched_output import SchedulerOutput
from octavo.runner.host_copy import to_device
from octavo.runner.outputs import PromptLogprobSpan
from octavo.runner.sampler import gather_logprobs

# Prompt log-probs take the logits of this many positions at a time: a long prompt chunk's
# then need at most ~250 MB more (a 150k vocabulary), not tens of GB.
PROMPT_LOGPROBS_ROWS = 128


def prompt_logprobs(
    so: SchedulerOutput, md: AttentionMetadata, hidden: torch.Tensor, requests: dict, model
) -> tuple[list[PromptLogprobSpan], tuple[torch.Tensor, ...]] | None:
    """Raw log-probs of the prompt tokens this step's chunks predict, for the requests
    that asked for them (`prompt_logprobs`): position p's logits score prompt token
    p + 1. Returns the spans and their (token ids, log-probs, ranks), or None."""
    if not so.scores_prompts:
        return None
    spans, index, targets = [], [], []
    starts = md.query_start_loc_cpu
    for i, s in enumerate(so.scheduled):
        state = requests[s.request_id]
        k = state.sampling_params.prompt_logprobs
        if k is None or s.num_output_tokens:  # an output: its prompt is scored
            continue
        prompt, first = state.prompt_token_ids, s.num_computed_tokens
        count = min(s.num_new_tokens, len(prompt) - 1 - first)
        if count <= 0:
            continue
        spans.append(PromptLogprobSpan(s.request_id, first, count, k))
        index += range(starts[i], starts[i] + count)
        targets += prompt[first + 1 : first + 1 + count]
    if not spans:
        return None
    k = max(span.k for span in spans)
    index_t = to_device(index, torch.int64, hidden.device)
    targets_t = to_device(targets, torch.int64, hidden.device)
    parts = []
    for lo in range(0, len(index), PROMPT_LOGPROBS_ROWS):
        rows = slice(lo, lo + PROMPT_LOGPROBS_ROWS)
        raw = model.compute_logits(hidden[index_t[rows]]).float().log_softmax(-1)
        parts.append(gather_logprobs(raw, targets_t[rows], k))
    return spans, tuple(torch.cat(column) for column in zip(*parts, strict=True))
