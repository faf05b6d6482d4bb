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

import numpy as np
import torch

from octavo.engine.structured_output import (
    Grammar,
    bitmask_width,
    fill_bitmasks,
    outside_of_bitmask,
)
from octavo.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_INF = float("inf")


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on `device`. On CUDA the copy goes from pinned memory
    without waiting (torch.tensor(..., device="cuda") would wait for all queued work)."""
    return upload(torch.tensor(values, dtype=dtype), device)


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, copied as `to_device` copies."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


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
    rows in one numpy pass (Python's big integers cost ~1 us a row, every step)."""
    if rows is None:
        rows = [row for row, p in enumerate(params) if p.seed is not None and not p.is_greedy]
    if not rows:
        return ()
    seeds = np.array([params[row].seed & _MASK64 for row in rows], dtype=np.uint64)
    counts = np.array([num_output_tokens[row] for row in rows], dtype=np.uint64)
    noise = _splitmix64(_splitmix64(seeds) ^ counts) >> np.uint64(1)
    return tuple(zip(rows, noise.tolist(), strict=True))


@dataclass
class PenaltyState:
    """Per-row penalty values and the token statistics they apply to."""

    presence: torch.Tensor  # [B, 1] float32
    frequency: torch.Tensor  # [B, 1] float32
    output_counts: torch.Tensor  # [B, V] float32: times each token was generated
    repetition: torch.Tensor | None = None  # [B, 1] float32; None when no row has one
    seen: torch.Tensor | None = None  # [B, V] bool: in the prompt or the output


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
        return (
            self.max_num_logprobs is None
            and self.banned is None
            and self.disallowed is None
            and self.grammar_bans is None
            and self.logit_bias is None
            and self.penalties is None
            and not self.has_filters
        )

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        vocab_size: int,
        eos_token_ids: list[int],
        device: torch.device,
        num_output_tokens: list[int] | None = None,
    ) -> SamplingMetadata:
        """Builds the step's metadata; row i samples for params[i], whose sequence is
        prompt_token_ids[i] + output_token_ids[i]. EOS and stop ids are banned while a row
        has fewer than min_tokens outputs (EOS not when it ignores EOS), and so is a bad
        word's last token where the output ends with the rest of it.

        `num_output_tokens[i]` is how many tokens row i's sequence has generated before
        this one (default: len(output_token_ids[i])); with async scheduling it counts a
        token still on its way from the previous step. Penalties and bad words of several
        tokens read output_token_ids, so they need every earlier token on the host
        (`SamplingParams.needs_output_token_ids`). Structured outputs' bans follow their
        grammars, not the tokens: the runner adds them each step (`GrammarMasks`).
        """
        if not len(params) == len(prompt_token_ids) == len(output_token_ids):
            raise ValueError("params, prompt_token_ids and output_token_ids differ in length")
        if num_output_tokens is None:
            num_output_tokens = [len(ids) for ids in output_token_ids]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        md = cls(
            num_rows=len(params),
            vocab_size=vocab_size,
            banned=_bans(
                params, output_token_ids, num_output_tokens, eos_token_ids, vocab_size, device
            ),
            max_num_logprobs=max(logprobs, default=None),
        )
        shaped = [(row, p) for row, p in enumerate(params) if p.logit_bias or p.allowed_token_ids]
        if shaped:
            md._build_logit_shaping(shaped, device)
        if any(p.has_penalties for p in params):
            md.penalties = _build_penalties(
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
            mask[_row_index(list(enumerate(t for _, t in allowed)), device), ids] = False
            self.disallowed = (to_device([row for row, _ in allowed], torch.int64, device), mask)
        biased = [(row, t[1], t[2]) for row, t in tensors if len(t[1])]
        if biased:
            ids = upload(torch.cat([ids for _, ids, _ in biased]), device)
            values = upload(torch.cat([values for _, _, values in biased]), device)
            rows_index = _row_index([(row, ids) for row, ids, _ in biased], device)
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


def _row_index(rows: list[tuple[int, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """The row of each element of the rows' tensors, concatenated in order: [N] int64."""
    counts = torch.tensor([len(t) for _, t in rows])
    return upload(torch.tensor([row for row, _ in rows]).repeat_interleave(counts), device)


def _flat_index(
    tokens_of_row: dict[int, list[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token id) of every listed token, as two [N] int64 tensors."""
    rows = [row for row, tokens in tokens_of_row.items() for _ in tokens]
    ids = [t for tokens in tokens_of_row.values() for t in tokens]
    row_index, id_index = to_device([rows, ids], torch.int64, device)  # [2, N]
    return row_index, id_index


def _build_penalties(
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
    index = _flat_index({r: output_ids[r] for r in rows}, device)
    counts.index_put_(index, torch.ones_like(index[0], dtype=torch.float32), accumulate=True)
    state = PenaltyState(column("presence_penalty"), column("frequency_penalty"), counts)
    repetition_rows = {r: prompt_ids[r] for r in rows if params[r].repetition_penalty != 1}
    if repetition_rows:
        state.repetition = column("repetition_penalty")
        state.seen = counts > 0
        state.seen[_flat_index(repetition_rows, device)] = True
    return state


def _bans(
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    num_output_tokens: list[int],
    eos_token_ids: list[int],
    vocab_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row, token id) of every token a row may not sample now, or None:
    - EOS and stop ids while the row has fewer than min_tokens outputs (EOS not when it
      ignores EOS);
    - the last token of each bad word whose other tokens the row's output ends with (as
      vLLM, the output only: a bad word does not match across the prompt's end)."""
    banned: dict[int, set[int]] = {}
    for row, (p, num_output) in enumerate(zip(params, num_output_tokens, strict=True)):
        if num_output < p.min_tokens:
            ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            banned[row] = {t for t in ids if t < vocab_size}  # the others are never sampled
        if not p.bad_words:
            continue
        output = output_token_ids[row]
        for word in p.bad_words_token_ids:
            start = len(word) - 1
            if start == 0 or (len(output) >= start and output[-start:] == word[:-1]):
                banned.setdefault(row, set()).add(word[-1])
    banned = {row: sorted(ids) for row, ids in banned.items() if ids}
    return _flat_index(banned, device) if banned else None


class GrammarMasks:
    """Structured outputs' bans for a step (`SamplingMetadata.grammar_bans`): llguidance
    fills each grammar's bitmask into host memory kept from step to step (pinned, on CUDA),
    and one copy takes them to the device. A runner keeps one, so that a step pins no new
    memory and uploads no row index that has not changed."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._host: torch.Tensor | None = None  # [capacity, W] int32
        self._copied: torch.cuda.Event | None = None  # after the last copy out of _host
        self._rows: tuple[list[int], torch.Tensor | None] = ([], None)  # and on the device

    def bans(self, grammars: list[Grammar | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the rows with a grammar [R], their bitmasks [R, W] on the device); grammars[i]
        is row i's grammar or None, and has taken every earlier token."""
        rows = [row for row, g in enumerate(grammars) if g is not None]
        if rows != self._rows[0]:
            self._rows = (rows, to_device(rows, torch.int64, self.device))
        host = self._buffer(len(rows))
        fill_bitmasks([grammars[row] for row in rows], host)
        if self.device.type != "cuda":
            return self._rows[1], host.clone()
        bitmask = host.to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return self._rows[1], bitmask

    def _buffer(self, num_rows: int) -> torch.Tensor:
        """The first num_rows rows of the host buffer, once its last copy is done."""
        if self._host is None or len(self._host) < num_rows:
            capacity = 1 << (num_rows - 1).bit_length()  # a batch that grows pins log2(B) times
            width = bitmask_width(self.vocab_size)
            pinned = self.device.type == "cuda"
            self._host = torch.empty(capacity, width, dtype=torch.int32, pin_memory=pinned)
            self._copied = None
        if self._copied is not None:
            self._copied.synchronize()  # done already unless the caller skipped a step
        return self._host[:num_rows]


def ban_outside_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """-inf in place for the tokens that bitmask[r] leaves out of logits[rows[r]]: one
    Triton kernel on CUDA, the unpacked mask through torch elsewhere."""
    if logits.is_cuda:
        from octavo.kernels.token_bitmask import ban_outside_bitmask_

        ban_outside_bitmask_(logits, rows, bitmask)
        return
    banned = outside_of_bitmask(bitmask, logits.shape[1])
    logits.index_put_((rows,), logits[rows].masked_fill(banned, float("-inf")))


def _ban_outside(
    logits: torch.Tensor, bans: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """-inf for the banned tokens of some rows (rows [R], banned [R, V] bool); returns the
    new logits and those rows of them."""
    rows, banned = bans
    masked = logits[rows].masked_fill(banned, float("-inf"))
    return logits.index_put((rows,), masked), masked


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


def apply_penalties(logits: torch.Tensor, penalties: PenaltyState) -> torch.Tensor:
    """Repetition over prompt and output tokens (a positive logit is divided by the penalty,
    a negative one multiplied), then `logit -= frequency * count + presence * (count > 0)`
    over output tokens. logits: [B, V] float32, returned as a new tensor."""
    if penalties.repetition is not None:
        rep = penalties.repetition
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        # A penalty near float32's limits must not make a logit inf (inf - inf is NaN later).
        fmax = torch.finfo(torch.float32).max
        # ... but a banned token (-inf) stays banned.
        penalized = torch.where(logits.isinf(), logits, penalized.clamp(-fmax, fmax))
        logits = torch.where(penalties.seen, penalized, logits)
    counts = penalties.output_counts
    return logits - penalties.frequency * counts - penalties.presence * (counts > 0)


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
    set whose probability reaches top_p; the most likely token always stays. The rest gets
    -inf. top_k: [B] int64 in [1, V] (V = off); top_p: [B] float in (0, 1] (1 = off).

    Rows are cut at a logit value found in each row's descending head: the largest top_k
    (or `head_size` tokens with top_p) via torch.topk, which on a CPU is much cheaper than
    a sort; only when some row's kept set does not fit in the head is the whole row sorted.
    NOTE: a token tied with the last kept one is kept too. On CUDA nothing here waits for
    the device: `max_top_k` (the largest top_k < V, from the host) sizes the head, and with
    top_p the whole row is sorted, since whether the head decides it is known only there.
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
        """Samples one token per row. logits: [B, V], any float dtype; not modified.

        On CUDA, random rows sample through two small Triton kernels (`sample_tokens`, by the
        inverse CDF); the logits stay in their dtype unless a log-prob, ban, penalty or filter
        needs float32.
        """
        assert logits.shape == (md.num_rows, md.vocab_size), (logits.shape, md.num_rows)
        given = logits
        if not (logits.is_cuda and md.is_plain):
            logits = logits.float()
        raw_logprobs = None
        if md.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(-1)  # [B, V]
        grammar_only = None  # the grammar rows as their grammars alone leave them
        if md.grammar_bans is not None:
            if logits is given:  # float() made no copy: leave the caller's logits alone
                logits = logits.clone(memory_format=torch.contiguous_format)
            ban_outside_bitmask(logits, *md.grammar_bans)
            if any(x is not None for x in (md.disallowed, md.logit_bias, md.banned, md.penalties)):
                grammar_only = logits[md.grammar_bans[0]]
        if md.disallowed is not None:
            logits, _ = _ban_outside(logits, md.disallowed)
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
