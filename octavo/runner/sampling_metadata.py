"""Sampling metadata: a step's per-row settings as device tensors, built on the host."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from octavo.core.sched_output import GrammarBitmask
from octavo.runner.host_copy import to_device, upload
from octavo.runner.penalties import PenaltyState, build_bans, build_penalties, row_index
from octavo.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def _shaping_tensors(p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A request's allowed token ids, biased token ids and biases as host tensors. They may
    span the vocabulary, so they are made once per SamplingParams object (validate() drops
    them) rather than once per step."""
    cached = p.__dict__.get("_shaping_tensors")
    if cached is None:
        bias = p.logit_bias or {}
        cached = (
            torch.tensor(p.allowed_token_ids or [], dtype=torch.int64),
            torch.tensor(list(bias), dtype=torch.int64),
            torch.tensor(list(bias.values()), dtype=torch.float32),
        )
        p.__dict__["_shaping_tensors"] = cached
    return cached


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer of each element of a uint64 array (numpy's uint64 arithmetic
    wraps, as the hash's 64-bit arithmetic does)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def seeded_rows(
    params: list[SamplingParams], num_output_tokens: list[int], rows: list[int] | None = None
) -> tuple[tuple[int, int], ...]:
    """(row, noise seed) of each seeded random row (`rows`, where known already). A row's
    63-bit noise seed hashes its seed and its number of output tokens so far, so nothing
    else about the batch matters: splitmix64(splitmix64(seed mod 2^64) ^ count) >> 1, all
    rows in one numpy pass (Python's big integers would cost a microsecond a row)."""
    if rows is None:
        rows = [row for row, p in enumerate(params) if p.seed is not None and not p.is_greedy]
    if not rows:
        return ()
    seeds = np.array([params[row].seed & _MASK64 for row in rows], dtype=np.uint64)
    counts = np.array([num_output_tokens[row] for row in rows], dtype=np.uint64)
    noise = _splitmix64(_splitmix64(seeds) ^ counts) >> np.uint64(1)
    return tuple(zip(rows, noise.tolist(), strict=True))


@dataclass
class SamplingMetadata:
    """Everything the sampler needs for one step, one row per sampling sequence.

    A field is None when no row needs it, so an all-greedy batch without penalties, bans or
    logprobs costs one argmax. Disabled rows hold neutral values (top_k = V, top_p = 1,
    min_p = 0, temperature = 1 on greedy rows).
    """

    num_rows: int
    vocab_size: int
    all_greedy: bool = True
    greedy_rows: torch.Tensor | None = None  # [B] bool; only when greedy and random rows mix
    temperature: torch.Tensor | None = None  # [B] float32; None when all rows are greedy
    top_k: torch.Tensor | None = None  # [B] int64 in [1, V]
    max_top_k: int | None = None  # the largest top_k < V of any row, known on the host
    top_p: torch.Tensor | None = None  # [B] float32 in (0, 1]
    min_p: torch.Tensor | None = None  # [B] float32 in [0, 1]
    seeded_rows: tuple[tuple[int, int], ...] = ()  # (row, noise seed) of seeded random rows
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) -> -inf
    # (rows with allowed_token_ids [R], [R, V] bool: the tokens outside them)
    disallowed: tuple[torch.Tensor, torch.Tensor] | None = None
    # (rows with a structured output's grammar [R], [R, ceil(V / 32)] int32: the bitmask of
    # the tokens it allows now, token t in bit t % 32 of word t // 32)
    grammar_bans: tuple[torch.Tensor, torch.Tensor] | None = None
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, ids, bias
    penalties: PenaltyState | None = None
    max_num_logprobs: int | None = None  # the largest `logprobs` of any row

    @property
    def has_filters(self) -> bool:
        return self.top_k is not None or self.top_p is not None or self.min_p is not None

    @property
    def is_plain(self) -> bool:
        """Only temperature (or greedy): the logits need no float32 copy."""
        extras = (self.max_num_logprobs, self.banned, self.disallowed, self.grammar_bans,
                  self.logit_bias, self.penalties)  # fmt: skip
        return all(x is None for x in extras) and not self.has_filters

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        vocab_size: int,
        device: torch.device,
        num_output_tokens: list[int] | None = None,
    ) -> SamplingMetadata:
        """Builds the step's metadata; row i samples for params[i], whose sequence is
        prompt_token_ids[i] + output_token_ids[i].

        `num_output_tokens[i]` is how many tokens row i's sequence has generated before
        this one (default: len(output_token_ids[i])); with async scheduling it counts a
        token still on its way from the previous step. Penalties and bad words of several
        tokens read output_token_ids, so they need every earlier token on the host
        (`SamplingParams.needs_output_token_ids`). Structured outputs' bans follow their
        grammars: the runner adds them each step (`GrammarMasks`).
        """
        if not len(params) == len(prompt_token_ids) == len(output_token_ids):
            raise ValueError("params, prompt_token_ids and output_token_ids differ in length")
        if num_output_tokens is None:
            num_output_tokens = [len(ids) for ids in output_token_ids]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        md = cls(
            num_rows=len(params),
            vocab_size=vocab_size,
            banned=build_bans(params, output_token_ids, num_output_tokens, vocab_size, device),
            max_num_logprobs=max(logprobs, default=None),
        )
        shaped = [(row, p) for row, p in enumerate(params) if p.logit_bias or p.allowed_token_ids]
        if shaped:
            md._build_logit_shaping(shaped, device)
        if any(p.has_penalties for p in params):
            md.penalties = build_penalties(
                params, prompt_token_ids, output_token_ids, vocab_size, device
            )
        if not all(p.is_greedy for p in params):
            md._build_random(params, num_output_tokens, device)
        return md

    def _build_logit_shaping(self, rows: list[tuple[int, SamplingParams]], device) -> None:
        """allowed_token_ids as a mask of the tokens outside them, for the rows that have
        them; logit_bias as sparse adds."""
        tensors = [(row, _shaping_tensors(p)) for row, p in rows]
        allowed = [(row, t[0]) for row, t in tensors if len(t[0])]
        if allowed:
            mask = torch.ones(len(allowed), self.vocab_size, dtype=torch.bool, device=device)
            ids = upload(torch.cat([ids for _, ids in allowed]), device)
            mask[row_index(list(enumerate(t for _, t in allowed)), device), ids] = False
            self.disallowed = (to_device([row for row, _ in allowed], torch.int64, device), mask)
        biased = [(row, t[1], t[2]) for row, t in tensors if len(t[1])]
        if biased:
            ids = upload(torch.cat([ids for _, ids, _ in biased]), device)
            values = upload(torch.cat([values for _, _, values in biased]), device)
            rows_index = row_index([(row, ids) for row, ids, _ in biased], device)
            self.logit_bias = (rows_index, ids, values)

    def _build_random(
        self, params: list[SamplingParams], num_output_tokens: list[int], device
    ) -> None:
        def per_row(values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return to_device(values, dtype, device)

        vocab = self.vocab_size
        greedy = [p.is_greedy for p in params]
        random = [None if g else p for p, g in zip(params, greedy)]  # greedy rows: neutral
        self.all_greedy = False
        if any(greedy):
            self.greedy_rows = per_row(greedy, torch.bool)
        self.temperature = per_row([p.temperature if p else 1.0 for p in random])
        top_k = [min(p.top_k, vocab) if p and p.top_k else vocab for p in random]
        if min(top_k) < vocab:
            self.top_k = per_row(top_k, torch.int64)
            self.max_top_k = max(k for k in top_k if k < vocab)
        if any(p and p.top_p < 1 for p in random):
            self.top_p = per_row([p.top_p if p else 1.0 for p in random])
        if any(p and p.min_p > 0 for p in random):
            self.min_p = per_row([p.min_p if p else 0.0 for p in random])
        self.seeded_rows = seeded_rows(params, num_output_tokens)


class GrammarMasks:
    """Structured outputs' bans for a step (`SamplingMetadata.grammar_bans`) from the
    engine's host bitmask: one copy to the device, and the row index uploaded only when the
    grammar rows change."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._rows: tuple[list[int], torch.Tensor | None] = ([], None)  # and on the device

    def bans(
        self, rows: list[tuple[str, SamplingParams, int]], grammar_bitmask: GrammarBitmask
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the sampling rows with a grammar [R], their bitmasks [R, W] on the device). An
        n > 1 request's first token samples n rows under its one bitmask row; a request that
        verifies guesses has a bitmask row for each of its sampling rows, in order."""
        first: dict[str, int] = {}
        count: dict[str, int] = {}
        for i, request_id in enumerate(grammar_bitmask.request_ids):
            first.setdefault(request_id, i)
            count[request_id] = count.get(request_id, 0) + 1
        grammar_rows = [row for row, r in enumerate(rows) if r[0] in first]
        if grammar_rows != self._rows[0]:
            self._rows = (grammar_rows, to_device(grammar_rows, torch.int64, self.device))
        host = grammar_bitmask.bitmask
        order, seen = [], {}
        for row in grammar_rows:
            request_id = rows[row][0]
            j = seen[request_id] = seen.get(request_id, -1) + 1
            order.append(first[request_id] + (j if count[request_id] > 1 else 0))
        if order != list(range(len(host))):
            host = host[order]
        if self.device.type != "cuda":
            return self._rows[1], host.clone()  # the engine's buffer serves the next step
        # NOTE: the engine fills its host buffer again only after this step's tokens came
        # back, so the copy from it is done by then.
        return self._rows[1], host.to(self.device, non_blocking=True)
