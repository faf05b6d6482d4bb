"""Log-probs: the sampled token's and the top-k's, gathered on the device."""

from __future__ import annotations

import torch


def gather_logprobs(
    raw: torch.Tensor, chosen: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From log-probs [B, V] and a chosen token per row [B]: the token ids [B, k + 1] and
    log-probs [B, k + 1] of the chosen token then the top k, and the chosen token's rank
    [B] (1 + the number of tokens more likely than it)."""
    chosen_logprob = raw.gather(-1, chosen[:, None])  # [B, 1]
    top_logprobs, top_ids = raw.topk(k, dim=-1)  # [B, k]
    token_ids = torch.cat([chosen[:, None], top_ids], dim=-1)
    logprobs = torch.cat([chosen_logprob, top_logprobs], dim=-1)
    return token_ids, logprobs, (raw > chosen_logprob).sum(-1) + 1
