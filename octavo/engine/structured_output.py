"""Structured outputs: a request's text held to a JSON schema, a regex, a choice or a grammar.

llguidance does the matching. The engine compiles a request's constraint into a `Grammar`
when it takes the request; each step the runner asks every such sequence's grammar which
tokens may come next (a bitmask over the vocabulary, one bit per token), and the sampler
bans the rest. The scheduler feeds each sampled token back to the grammar, and finishes
the sequence once the grammar is complete:

    {"type": "object", ...}  -> Grammar --mask--> sampler --token--> Grammar.accept -> ...

A mask needs every earlier token accepted. With async scheduling the next step launches its
forward pass at once and the runner holds its sampling until the engine has fed the grammars
the finished step's tokens and built the step's `GrammarBitmask` (`ModelRunner.sample_tokens`).
An n > 1 request's samples each get their own copy of the grammar when they fork.
"""

from __future__ import annotations

import functools
import json
import logging

import torch

from octavo.core.sched_output import GrammarBitmask
from octavo.runner.penalties import bitmask_width, outside_of_bitmask
from octavo.sampling_params import StructuredOutputsParams
from octavo.tokenizer.fast_tokenizer import FastTokenizer

logger = logging.getLogger(__name__)


class Grammar:
    """One sequence's place in its constraint (an llguidance matcher)."""

    def __init__(self, matcher) -> None:
        self._matcher = matcher

    def fork(self) -> Grammar:
        """An independent copy in the same place (an n > 1 request's next sample)."""
        return Grammar(self._matcher.deep_copy())

    def accept(self, token_id: int) -> bool:
        """Moves past a sampled token; False (logged) if the grammar refuses it."""
        if self._matcher.consume_token(token_id):
            return True
        self._log_refusal(token_id)
        return False

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of the tokens, in order, the grammar would take from here (it does not
        move)."""
        return self._matcher.validate_tokens(token_ids)

    def fill_bitmasks_along(self, token_ids: list[int], rows: torch.Tensor) -> None:
        """rows[0] gets the allowed tokens here, rows[j] those after token_ids[:j] (the
        grammar takes them, then rolls back): the masks of a step that verifies guesses."""
        self.fill_bitmask(rows[0])
        for j, token_id in enumerate(token_ids, start=1):
            self._matcher.consume_token(token_id)
            self.fill_bitmask(rows[j])
        if token_ids:
            self._matcher.rollback(len(token_ids))

    def _log_refusal(self, token_id: int) -> None:
        error = self._matcher.get_error()  # may hold the whole grammar: cut it short
        logger.warning("a structured output's grammar refused token %d: %.300s", token_id, error)

    @property
    def is_complete(self) -> bool:
        """True once the text matches and nothing but EOS could follow it."""
        return self._matcher.is_stopped()

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Writes the allowed next tokens into `row` ([ceil(V / 32)] int32, on the CPU, bit
        t % 32 of word t // 32 set for an allowed token t)."""
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    @property
    def error(self) -> str | None:
        """Why the grammar cannot go on (a lexer past llguidance's limits, say), or None."""
        return self._matcher.get_error() if self._matcher.is_error() else None


class GrammarCompiler:
    """Compiles StructuredOutputsParams into Grammars for one model. llguidance's view of
    the tokenizer takes ~1 s to build, so it is built once, on the first request."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._ll_tokenizer = None

    def _build_ll_tokenizer(self, llguidance):
        # The model's config may name an EOS id the tokenizer does not have.
        eos = [t for t in self.eos_token_ids if t < len(self.tokenizer)] or None
        if isinstance(self.tokenizer, FastTokenizer):  # its backend pads and truncates nothing
            eos = eos or self.tokenizer.eos_token_id
            json_text = self.tokenizer.backend_tokenizer.to_str()
            return llguidance.LLTokenizer(json_text, n_vocab=self.vocab_size, eos_token=eos)
        import llguidance.hf

        try:
            return llguidance.hf.from_tokenizer(
                self.tokenizer, n_vocab=self.vocab_size, eos_token=eos
            )
        except ValueError as e:  # a slow tokenizer, say
            raise ValueError(f"structured_outputs cannot use this tokenizer: {e}") from None

    def compile(self, spec: StructuredOutputsParams) -> Grammar:
        """A fresh Grammar for the constraint; ValueError naming the problem if it does not
        compile (a bad schema, regex or grammar)."""
        llguidance = _import_llguidance()
        if self._ll_tokenizer is None:
            self._ll_tokenizer = self._build_ll_tokenizer(llguidance)
        try:
            grammar = _grammar_text(llguidance, spec)
        except ValueError as e:
            raise ValueError(f"structured_outputs does not compile: {e}") from None
        compiled = Grammar(llguidance.LLMatcher(self._ll_tokenizer, grammar, log_level=0))
        error = compiled.error or self._first_step_error(compiled)
        if error is not None:
            raise ValueError(f"structured_outputs does not compile: {error:.2000}")
        return compiled

    def _first_step_error(self, grammar: Grammar) -> str | None:
        """llguidance builds its lexer lazily, so a constraint past its limits (a regex
        like x{1000}{1000}) fails only at the first mask or token. Take one step on a copy,
        so that it fails here, as bad input, rather than in a step of the engine."""
        mask = torch.zeros(bitmask_width(self.vocab_size), dtype=torch.int32)
        grammar.fill_bitmask(mask)
        allowed = outside_of_bitmask(mask[None], self.vocab_size)[0].logical_not().nonzero()
        if grammar.error is None and len(allowed):
            probe = grammar.fork()
            probe._matcher.consume_token(int(allowed[0]))  # not accept(): no warning
            return probe.error
        return grammar.error


class GrammarBitmaskBuilder:
    """Builds a step's `GrammarBitmask` beside the scheduler, in host memory kept from step
    to step (pinned for a CUDA runner, and grown by powers of two)."""

    def __init__(self, vocab_size: int, pin_memory: bool) -> None:
        self.vocab_size = vocab_size
        self.pin_memory = pin_memory
        self._host: torch.Tensor | None = None  # [capacity, W] int32

    def build(
        self,
        request_ids: list[str],
        grammars: list[Grammar],
        guesses: list[list[int]] | None = None,
    ) -> GrammarBitmask:
        """The bitmask of each request's grammar, which has taken every earlier token; a
        request that verifies speculative guesses (`guesses[i]`) gets a row more for each,
        the mask after the guesses before it.

        NOTE: the runner copies it to the device without waiting; the engine builds the next
        one only after that step's tokens came back, so the buffer is free again by then.
        """
        if guesses is not None and any(guesses):
            return self._build_along(request_ids, grammars, guesses)
        host = self._rows(len(request_ids))
        fill_bitmasks(grammars, host)
        return GrammarBitmask(request_ids, host)

    def _build_along(
        self, request_ids: list[str], grammars: list[Grammar], guesses: list[list[int]]
    ) -> GrammarBitmask:
        rows = [rid for rid, g in zip(request_ids, guesses, strict=True) for _ in range(len(g) + 1)]
        host = self._rows(len(rows))
        start = 0
        for grammar, along in zip(grammars, guesses, strict=True):
            grammar.fill_bitmasks_along(along, host[start : start + len(along) + 1])
            start += len(along) + 1
        return GrammarBitmask(rows, host)

    def _rows(self, num_rows: int) -> torch.Tensor:
        """The first `num_rows` rows of the host buffer, grown by powers of two."""
        if self._host is None or len(self._host) < num_rows:
            capacity = 1 << (num_rows - 1).bit_length()
            width = bitmask_width(self.vocab_size)
            self._host = torch.empty(capacity, width, dtype=torch.int32, pin_memory=self.pin_memory)
        return self._host[:num_rows]


def fill_bitmasks(grammars: list[Grammar], bitmask: torch.Tensor) -> None:
    """Row i of `bitmask` ([R, W] int32, contiguous, on the CPU) gets grammars[i]'s allowed
    tokens. llguidance fills the rows on its threads; a grammar listed several times (an
    n > 1 request's first token) is computed once."""
    first: dict[int, int] = {}  # id(grammar) -> its first row
    for i, g in enumerate(grammars):
        first.setdefault(id(g), i)
    if len(first) == 1:
        grammars[0].fill_bitmask(bitmask[0])
    else:
        matchers = [(grammars[i]._matcher, i) for i in first.values()]
        _executor().unsafe_compute_mask_ptr(
            matchers, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0]
        )
    for i, g in enumerate(grammars):
        if first[id(g)] != i:
            bitmask[i] = bitmask[first[id(g)]]


# From this many grammars on, accept_tokens hands them to llguidance's threads: the threads'
# fixed cost pays only for a large batch (docs/PERFORMANCE.md has the crossover).
PARALLEL_ACCEPT_MIN = 96


def accept_tokens(grammars: list[Grammar], tokens: list[int]) -> list[bool]:
    """Grammar i moves past tokens[i], as `Grammar.accept`; many distinct grammars move on
    llguidance's threads at once."""
    if len(grammars) < PARALLEL_ACCEPT_MIN or len(set(map(id, grammars))) < len(grammars):
        return [g.accept(t) for g, t in zip(grammars, tokens, strict=True)]
    pairs = [(g._matcher, t) for g, t in zip(grammars, tokens, strict=True)]
    accepted = _executor().consume_token_par(pairs)
    for g, t, ok in zip(grammars, tokens, accepted, strict=True):
        if not ok:
            g._log_refusal(t)
    return accepted


@functools.cache
def _executor():
    """llguidance's thread pool for filling masks: one for the process."""
    return _import_llguidance().LLExecutor()


def _grammar_text(llguidance, spec: StructuredOutputsParams) -> str:
    options = {"whitespace_flexible": not spec.disable_any_whitespace}
    if spec.json is not None or spec.json_object:
        schema = {"type": "object"} if spec.json_object else spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    kind = next((k for k in ("regex", "choice") if getattr(spec, k) is not None), "grammar")
    return llguidance.grammar_from(kind, getattr(spec, kind))


def _import_llguidance():
    try:
        import llguidance
    except ImportError:
        raise ValueError(
            "structured_outputs needs the llguidance package: pip install llguidance"
        ) from None
    return llguidance
