"""The sampler: one token per row from a step's logits, and log-probs when asked for.

Order, as in vLLM v1:

    raw logits -> log_softmax (float32)                 only if a row wants logprobs
               -> structured outputs' grammars and allowed_token_ids (the others = -inf),
                  logit_bias (added)
               -> min_tokens bans (EOS, stop ids) and bad words (= -inf)
               -> penalties (repetition, frequency, presence)
               -> (ours) a grammar row that none of its grammar's tokens survived: the
                  grammar's mask alone
               -> greedy rows: argmax
               -> random rows: / temperature -> min-p -> top-k -> top-p
                               -> argmax(probs / Exp(1) noise)

The exponential race picks token i with probability probs[i] and needs only independent noise
per row, so a seeded row draws its noise from its own generator, seeded from (seed, number of
output tokens so far): its tokens do not depend on the batch, the step split or preemption.
On CUDA the random rows go through `octavo/kernels/sample.py` instead: the inverse CDF, with
one uniform per row keyed the same way.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from octavo.runner.host_copy import to_device
from octavo.runner.penalties import apply_penalties, ban_outside, ban_outside_bitmask
from octavo.runner.sampling_metadata import SamplingMetadata

_INF = float("inf")


@dataclass
class SamplerOutput:
    """The sampled token of each row and, when any row asked for logprobs, raw log-probs.

    `logprob_token_ids[:, 0]` is the sampled token, then come the top-K tokens by raw
    log-prob, K = `max_num_logprobs`. NOTE: a row that asked for k < K logprobs uses only
    its first k + 1 entries; rows that asked for none ignore them.
    """

    sampled_token_ids: torch.Tensor  # [B] int64
    logprob_token_ids: torch.Tensor | None = None  # [B, K + 1] int64
    logprobs: torch.Tensor | None = None  # [B, K + 1] float32
    sampled_token_ranks: torch.Tensor | None = None  # [B] int64, 1 = the most likely token


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


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drops (-inf) tokens whose probability is below min_p[row] times the row's largest.
    In log space: logit < max logit + log(min_p). logits: [B, V], min_p: [B]."""
    threshold = logits.amax(-1, keepdim=True) + min_p.log()[:, None]  # [B, 1]
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    head_size: int = 1024,
    max_top_k: int | None = None,
) -> torch.Tensor:
    """Keeps each row's top_k most likely tokens, then, of those (renormalized), the smallest
    set whose probability reaches top_p (at least the most likely token); the rest gets -inf.
    top_k: [B] int64 in [1, V] (V = off); top_p: [B] float in (0, 1] (1 = off).

    Rows are cut at a logit found in their descending head (torch.topk of the largest top_k,
    or of `head_size` with top_p: on a CPU much cheaper than a sort); whole rows are sorted
    only when a kept set overflows the head. A token tied with the last kept one stays. On
    CUDA nothing waits for the device: `max_top_k` comes from the host, and with top_p the
    rows are sorted, since only the device knows whether the head decides them.
    """
    vocab = logits.shape[-1]
    on_cuda = logits.device.type == "cuda"
    if top_k is None:
        top_k = torch.full(logits.shape[:1], vocab, dtype=torch.int64, device=logits.device)
        max_top_k = 1
    elif max_top_k is None:
        max_top_k = int(top_k.masked_fill(top_k >= vocab, 1).max())
    width = max_top_k if top_p is None else max(max_top_k, head_size)
    cutoff = None
    if width < vocab and not (on_cuda and top_p is not None):
        head = logits.topk(width, dim=-1).values  # [B, W], descending
        cutoff, complete = _cutoff(head, logits, top_k, top_p)
        if not complete.all():
            cutoff = None
    if cutoff is None:
        cutoff, _ = _cutoff(logits.sort(dim=-1, descending=True).values, logits, top_k, top_p)
    return logits.masked_fill(logits < cutoff, float("-inf"))


def _cutoff(
    head: torch.Tensor, logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest kept logit of each row ([B, 1], -inf to keep all) from its descending
    head ([B, W]), and whether the head decided it ([B] bool)."""
    width, vocab = head.shape[-1], logits.shape[-1]
    head = head.masked_fill(torch.arange(width, device=head.device) >= top_k[:, None], -_INF)
    num_kept = top_k
    if top_p is not None:
        # Renormalize over the top-k tokens; with top-k off, over the whole (unsorted) row.
        log_norm = torch.where(
            top_k[:, None] < vocab,
            head.logsumexp(-1, keepdim=True),
            logits.logsumexp(-1, keepdim=True),
        )  # [B, 1]
        cumulative = (head - log_norm).exp().cumsum(-1)  # [B, W]
        # The kept prefix: tokens whose prefix mass is below top_p, then the one reaching it.
        reach = (cumulative < top_p[:, None]).sum(-1) + 1  # [B], W + 1 if not reached
        num_kept = torch.where(top_p < 1, torch.minimum(reach, top_k), top_k)
    keep_all = num_kept >= vocab  # NOTE: width >= every top_k < V, so log_norm is right
    complete = keep_all | (num_kept <= width)
    cutoff = head.gather(-1, num_kept.clamp(max=width)[:, None] - 1)  # [B, 1]
    return cutoff.masked_fill(keep_all[:, None], -_INF), complete


def apply_filters(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Temperature, min-p, top-k and top-p for the random rows: the logits whose softmax the
    token is drawn from. logits: [B, V] float32 (penalized), returned as a new tensor."""
    assert md.temperature is not None, "all rows are greedy"
    logits = logits / md.temperature[:, None]
    if md.min_p is not None:
        logits = apply_min_p(logits, md.min_p)
    if md.top_k is not None or md.top_p is not None:
        logits = apply_top_k_top_p(logits, md.top_k, md.top_p, max_top_k=md.max_top_k)
    return logits


class Sampler:
    """Turns a step's logits into one token per row; see the module docstring for the order.

    Unseeded random rows share this sampler's generator (seeded with `seed`, one per device),
    so their tokens depend on the batch; seeded rows do not.
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self._host_rng = random.Random(seed)  # noise seeds of the fused CUDA path

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """Samples one token per row. logits: [B, V], any float dtype; not modified. On CUDA
        they stay in their dtype unless a log-prob, ban, penalty or filter needs float32."""
        assert logits.shape == (md.num_rows, md.vocab_size), (logits.shape, md.num_rows)
        given = logits
        if not (logits.is_cuda and md.is_plain):
            logits = logits.float()
        raw_logprobs = None if md.max_num_logprobs is None else logits.log_softmax(-1)  # [B, V]
        grammar_only = None  # the grammar rows as their grammars alone leave them
        if md.grammar_bans is not None:
            if logits is given:  # float() made no copy: leave the caller's logits alone
                logits = logits.clone(memory_format=torch.contiguous_format)
            ban_outside_bitmask(logits, *md.grammar_bans)
            if any(x is not None for x in (md.disallowed, md.logit_bias, md.banned, md.penalties)):
                grammar_only = logits[md.grammar_bans[0]]
        if md.disallowed is not None:
            logits, _ = ban_outside(logits, md.disallowed)
        if md.logit_bias is not None:
            rows, ids, bias = md.logit_bias
            logits = logits.index_put((rows, ids), bias, accumulate=True)
        if md.banned is not None:
            logits = logits.index_put(md.banned, torch.tensor(float("-inf")))
        if md.penalties is not None:
            logits = apply_penalties(logits, md.penalties)
        if grammar_only is not None:
            # A structured output is the hard constraint: where the other bans leave none of
            # the grammar's tokens, the grammar alone decides (else the row would sample a
            # token the grammar refuses).
            rows = md.grammar_bans[0]
            now = logits[rows]
            nothing_left = (now == float("-inf")).all(-1, keepdim=True)
            logits = logits.index_put((rows,), torch.where(nothing_left, grammar_only, now))
        if md.all_greedy:
            sampled = logits.argmax(-1)
        else:
            sampled = self._sample_cuda(logits, md) if logits.is_cuda else self._sample(logits, md)
            if md.greedy_rows is not None:
                sampled = torch.where(md.greedy_rows, logits.argmax(-1), sampled)
        out = SamplerOutput(sampled)
        if raw_logprobs is not None:
            out.logprob_token_ids, out.logprobs, out.sampled_token_ranks = gather_logprobs(
                raw_logprobs, sampled, md.max_num_logprobs
            )
        return out

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device).manual_seed(self.seed)
        return self._generators[device]

    def _sample_cuda(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """The Triton sampler (CUDA). Seeded rows key its uniform with their own seed; the
        others with seeds drawn from `_host_rng` (seeded by the sampler's seed)."""
        from octavo.kernels.sample import sample_tokens

        temperature = md.temperature
        if md.has_filters:
            logits = apply_filters(logits, md)  # scaled by the temperature already
            temperature = torch.ones_like(temperature)
        seeds = [self._host_rng.getrandbits(63) for _ in range(md.num_rows)]
        for row, seed in md.seeded_rows:
            seeds[row] = seed
        return sample_tokens(logits, temperature, to_device(seeds, torch.int64, logits.device))

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        probs = apply_filters(logits, md).softmax(-1)  # [B, V]
        # Exp(1) noise as -log(U), U in [0, 1): never 0, so a dropped token (prob 0) never
        # wins with 0 / 0 = nan; and on a CPU, 3x cheaper than Tensor.exponential_.
        uniform = torch.rand(
            probs.shape, generator=self._generator(probs.device), device=probs.device
        )
        for row, seed in md.seeded_rows:
            own = torch.Generator(probs.device).manual_seed(seed)
            uniform[row] = torch.rand(probs.shape[-1], generator=own, device=probs.device)
        noise = uniform.log_().neg_()  # [B, V]
        return probs.div_(noise).argmax(-1)
