"""Penalties and bans: what a row may not sample now, and how earlier tokens weigh on it.

Bans (-inf): min_tokens (EOS and stop ids), bad words, allowed_token_ids, structured outputs'
grammars (a packed bitmask of the allowed tokens: token t allowed when bit t % 32 of int32
word t // 32 is set); penalties: repetition, frequency and presence over the row's earlier
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from octavo.runner.host_copy import to_device, upload
from octavo.sampling_params import SamplingParams


@dataclass
class PenaltyState:
    """Per-row penalty values and the token statistics they apply to."""

    presence: torch.Tensor  # [B, 1] float32
    frequency: torch.Tensor  # [B, 1] float32
    output_counts: torch.Tensor  # [B, V] float32: times each token was generated
    repetition: torch.Tensor | None = None  # [B, 1] float32; None when no row has one
    seen: torch.Tensor | None = None  # [B, V] bool: in the prompt or the output


def row_index(rows: list[tuple[int, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """The row of each element of the rows' tensors, concatenated in order: [N] int64."""
    counts = torch.tensor([len(t) for _, t in rows])
    return upload(torch.tensor([row for row, _ in rows]).repeat_interleave(counts), device)


def flat_index(
    tokens_of_row: dict[int, list[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token id) of every listed token, as two [N] int64 tensors."""
    rows = [row for row, tokens in tokens_of_row.items() for _ in tokens]
    ids = [t for tokens in tokens_of_row.values() for t in tokens]
    return to_device([rows, ids], torch.int64, device).unbind()  # [2, N] -> two [N]


def build_penalties(
    params: list[SamplingParams],
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    vocab_size: int,
    device: torch.device,
) -> PenaltyState:
    def column(name: str) -> torch.Tensor:
        values = [getattr(p, name) for p in params]
        return to_device(values, torch.float32, device)[:, None]  # [B, 1]

    rows = [r for r, p in enumerate(params) if p.has_penalties]
    counts = torch.zeros(len(params), vocab_size, dtype=torch.float32, device=device)
    index = flat_index({r: output_ids[r] for r in rows}, device)
    counts.index_put_(index, torch.ones_like(index[0], dtype=torch.float32), accumulate=True)
    state = PenaltyState(column("presence_penalty"), column("frequency_penalty"), counts)
    repetition_rows = {r: prompt_ids[r] for r in rows if params[r].repetition_penalty != 1}
    if repetition_rows:
        state.repetition = column("repetition_penalty")
        state.seen = counts > 0
        state.seen[flat_index(repetition_rows, device)] = True
    return state


def build_bans(
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    num_output_tokens: list[int],
    vocab_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row, token id) of every token a row may not sample now, or None:
    - the ids that would stop the row (`all_stop_token_ids`: EOS unless it ignores EOS,
      and its stop ids) while it has fewer than min_tokens outputs;
    - the last token of each bad word whose other tokens the row's output ends with (as
      vLLM, the output only: a bad word does not match across the prompt's end)."""
    banned: dict[int, set[int]] = {}
    for row, (p, num_output) in enumerate(zip(params, num_output_tokens, strict=True)):
        if num_output < p.min_tokens:
            # Ids past the vocabulary are never sampled.
            banned[row] = {t for t in p.all_stop_token_ids if t < vocab_size}
        if not p.bad_words:
            continue
        output = output_token_ids[row]
        for word in p.bad_words_token_ids:
            start = len(word) - 1
            if start == 0 or (len(output) >= start and output[-start:] == word[:-1]):
                banned.setdefault(row, set()).add(word[-1])
    banned = {row: sorted(ids) for row, ids in banned.items() if ids}
    return flat_index(banned, device) if banned else None


def apply_penalties(logits: torch.Tensor, penalties: PenaltyState) -> torch.Tensor:
    """Repetition over prompt and output tokens (a positive logit is divided by the penalty,
    a negative one multiplied), then `logit -= frequency * count + presence * (count > 0)`
    over output tokens. logits: [B, V] float32, returned as a new tensor."""
    if penalties.repetition is not None:
        rep = penalties.repetition
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        # A penalty near float32's limits must not make a logit inf (inf - inf is NaN later),
        # but a banned token (-inf) stays banned.
        fmax = torch.finfo(torch.float32).max
        penalized = torch.where(logits.isinf(), logits, penalized.clamp(-fmax, fmax))
        logits = torch.where(penalties.seen, penalized, logits)
    counts = penalties.output_counts
    return logits - penalties.frequency * counts - penalties.presence * (counts > 0)


def bitmask_width(vocab_size: int) -> int:
    """int32 words of a grammar's bitmask over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def outside_of_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 bitmasks -> [R, vocab_size] bool, True for a token the grammar bans.
    Unpacked a byte at a time (token t is bit t % 8 of little-endian byte t // 8), so the
    temporaries take a byte per token."""
    octets = bitmask.contiguous().view(torch.uint8)  # [R, 4W]
    bits = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    allowed = (octets.unsqueeze(-1) >> bits) & 1  # [R, 4W, 8]
    return (allowed == 0).flatten(1)[:, :vocab_size]


def ban_outside_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """-inf in place for the tokens that bitmask[r] leaves out of logits[rows[r]]: one
    Triton kernel on CUDA, the unpacked mask through torch elsewhere."""
    if logits.is_cuda:
        from octavo.kernels.token_bitmask import ban_outside_bitmask_

        ban_outside_bitmask_(logits, rows, bitmask)
        return
    banned = outside_of_bitmask(bitmask, logits.shape[1])
    logits.index_put_((rows,), logits[rows].masked_fill(banned, float("-inf")))


def ban_outside(
    logits: torch.Tensor, bans: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """-inf for the banned tokens of some rows (rows [R], banned [R, V] bool); returns the
    new logits and those rows of them."""
    rows, banned = bans
    masked = logits[rows].masked_fill(banned, float("-inf"))
    return logits.index_put((rows,), masked), masked
