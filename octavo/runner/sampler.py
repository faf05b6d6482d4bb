"""The sampler: penalties, temperature, min-p / top-k / top-p, then one token per row.

Order, as in vLLM v1: log-probs are taken from the raw logits; then min_tokens bans and
penalties; greedy rows take the argmax; random rows are divided by their temperature,
filtered, and sampled with the exponential race (argmax of probs / Exp(1) noise), which lets
a seeded row draw its noise from its own generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from octavo.sampling_params import SamplingParams

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant, spreads (seed, step) over 63 bits


def row_seed(seed: int, step: int) -> int:
    """The noise seed of a seeded request's step-th token: stateless, so a request samples
    the same way whatever else is in the batch and after a preemption."""
    return (seed * _MIX + step * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


@dataclass
class SamplingMetadata:
    """Per-row tensors for one step; a field is None when no row needs it."""

    num_rows: int
    all_greedy: bool
    greedy_rows: torch.Tensor | None  # [B] bool
    temperature: torch.Tensor | None  # [B] float32 (1.0 on greedy rows)
    top_k: torch.Tensor | None  # [B] int64, vocab size where disabled
    top_p: torch.Tensor | None  # [B] float32
    min_p: torch.Tensor | None  # [B] float32
    row_seeds: list[tuple[int, int]]  # (row, noise seed) of seeded random rows
    bans: list[tuple[int, list[int]]]  # (row, token ids banned this step)
    presence: torch.Tensor | None  # [B, 1]
    frequency: torch.Tensor | None  # [B, 1]
    repetition: torch.Tensor | None  # [B, 1]
    output_counts: torch.Tensor | None  # [B, V] float32 counts of generated tokens
    seen_mask: torch.Tensor | None  # [B, V] bool, prompt or generated
    max_num_logprobs: int | None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        vocab_size: int,
        eos_token_ids: list[int],
        device: torch.device,
    ) -> SamplingMetadata:
        rows = len(params)
        greedy = [p.is_greedy for p in params]
        random_rows = [i for i, g in enumerate(greedy) if not g]

        def per_row(values: list[float], dtype=torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        md = cls(
            num_rows=rows,
            all_greedy=not random_rows,
            greedy_rows=per_row(greedy, torch.bool) if random_rows else None,
            temperature=None,
            top_k=None,
            top_p=None,
            min_p=None,
            row_seeds=[
                (i, row_seed(params[i].seed, len(output_token_ids[i])))
                for i in random_rows
                if params[i].seed is not None
            ],
            bans=_min_tokens_bans(params, output_token_ids, eos_token_ids),
            presence=None,
            frequency=None,
            repetition=None,
            output_counts=None,
            seen_mask=None,
            max_num_logprobs=max(
                (p.logprobs for p in params if p.logprobs is not None), default=None
            ),
        )
        if random_rows:
            md.temperature = per_row([1.0 if g else p.temperature for p, g in zip(params, greedy)])
            if any(p.top_k is not None for p in params):
                md.top_k = per_row([p.top_k or vocab_size for p in params], torch.int64)
            if any(p.top_p < 1.0 for p in params):
                md.top_p = per_row([p.top_p for p in params])
            if any(p.min_p > 0 for p in params):
                md.min_p = per_row([p.min_p for p in params])
        if any(p.has_penalties for p in params):
            md._build_penalties(params, prompt_token_ids, output_token_ids, vocab_size, device)
        return md

    def _build_penalties(self, params, prompt_ids, output_ids, vocab_size, device) -> None:
        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)[:, None]

        self.presence = column([p.presence_penalty for p in params])
        self.frequency = column([p.frequency_penalty for p in params])
        self.repetition = column([p.repetition_penalty for p in params])
        counts = torch.zeros(len(params), vocab_size, dtype=torch.float32, device=device)
        seen = torch.zeros(len(params), vocab_size, dtype=torch.bool, device=device)
        for row, (prompt, output) in enumerate(zip(prompt_ids, output_ids, strict=True)):
            if output:
                out = torch.tensor(output, dtype=torch.int64, device=device)
                counts[row].index_add_(0, out, torch.ones_like(out, dtype=torch.float32))
            if params[row].repetition_penalty != 1:
                seen[row, torch.tensor(prompt, dtype=torch.int64, device=device)] = True
        self.output_counts = counts
        self.seen_mask = seen | (counts > 0)


def _min_tokens_bans(params, output_ids, eos_token_ids) -> list[tuple[int, list[int]]]:
    bans = []
    for row, (p, out) in enumerate(zip(params, output_ids, strict=True)):
        if len(out) < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
            if banned:
                bans.append((row, banned))
    return bans


@dataclass
class SamplerOutput:
    """The sampled token of each row and, when asked for, log-probs from the raw logits.

    `logprob_token_ids[:, 0]` is the sampled token, then the top-K tokens (K = the largest
    `logprobs` of any row; a row that asked for k < K uses its first k + 1 entries).
    """

    sampled_token_ids: torch.Tensor  # [B] int64
    logprob_token_ids: torch.Tensor | None = None  # [B, K + 1] int64
    logprobs: torch.Tensor | None = None  # [B, K + 1] float32
    sampled_token_ranks: torch.Tensor | None = None  # [B] int64, 1 = most likely


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Repetition over prompt and output tokens; presence and frequency over output only."""
    if md.output_counts is None:
        return logits
    rep = md.repetition.expand_as(logits)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(md.seen_mask, penalized, logits)
    return logits - md.frequency * md.output_counts - md.presence * (md.output_counts > 0)


def apply_filters(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """min-p, top-k and top-p on temperature-scaled logits; dropped tokens get -inf."""
    if md.min_p is not None:
        probs = logits.softmax(-1)
        too_unlikely = probs < md.min_p[:, None] * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(too_unlikely, float("-inf"))
    if md.top_k is None and md.top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if md.top_k is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
        drop |= ranks >= md.top_k[:, None]
    if md.top_p is not None:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        mass_before = probs.cumsum(-1) - probs  # probability of the strictly better tokens
        drop |= mass_before >= md.top_p[:, None]
        drop[:, 0] = False  # the most likely token always stays
    return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


class Sampler:
    """Turns a step's logits into one token per row (see the module docstring)."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device).manual_seed(self.seed)
        return self._generators[device]

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """logits: [B, V] -> SamplerOutput."""
        logits = logits.float()
        raw_logprobs = logits.log_softmax(-1) if md.max_num_logprobs is not None else None
        for row, banned in md.bans:
            logits[row, banned] = float("-inf")
        logits = apply_penalties(logits, md)
        sampled = logits.argmax(-1)
        if not md.all_greedy:
            sampled = torch.where(md.greedy_rows, sampled, self._sample(logits, md))
        out = SamplerOutput(sampled)
        if raw_logprobs is not None:
            _gather_logprobs(raw_logprobs, sampled, md.max_num_logprobs, out)
        return out

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        probs = apply_filters(logits / md.temperature[:, None], md).softmax(-1)
        noise = torch.empty_like(probs).exponential_(generator=self._generator(probs.device))
        for row, seed in md.row_seeds:
            gen = torch.Generator(probs.device).manual_seed(seed)
            noise[row].exponential_(generator=gen)
        return (probs / noise).argmax(-1)


def _gather_logprobs(
    raw: torch.Tensor, sampled: torch.Tensor, k: int, out: SamplerOutput
) -> None:
    sampled_lp = raw.gather(-1, sampled[:, None])  # [B, 1]
    top_lp, top_ids = raw.topk(k, dim=-1) if k > 0 else (raw[:, :0], sampled[:, None][:, :0])
    out.logprob_token_ids = torch.cat([sampled[:, None], top_ids], dim=-1)
    out.logprobs = torch.cat([sampled_lp, top_lp], dim=-1)
    out.sampled_token_ranks = (raw > sampled_lp).sum(-1) + 1
