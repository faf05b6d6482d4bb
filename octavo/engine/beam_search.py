"""Beam search on the engine's paged KV cache, with HF transformers' selection rules.

Each live beam is a Request that samples nothing itself: it only reports the top-K log-probs
of its next token. Once every live beam of a prompt has reported, the search picks the next
beams, and the beams' requests follow by ref count, not by copying KV:

    step t   beam a: [prompt | x y]   beam b: [prompt | x z]     (prompt blocks shared)
    picks    a+p, a+q, b+r            -> fork a into a', append p to a, q to a', r to b
    step t+1 beam a: [.. x y p]   a': [.. x y q]   b: [.. x z r]  (a' shares all of a's blocks)

An unpicked beam is finished at once and its blocks are freed. A fork shares every block of
its parent; the shared partial last block is copied when one of them first writes into it
(copy-on-write, in the KV cache manager). A beam that has reported needs no KV until it is
picked, so when the cache runs short (a preempted beam waits while its reported siblings
hold their blocks) reported beams are parked: their requests are finished, and a picked
parked beam comes back as a fork that recomputes its tokens.

Selection (HF `GenerationMixin._beam_search`, transformers 5.x): the step's candidates are
the top 2 x beam_width of (beam, token) pairs by accumulated log-prob (the first step has a
single beam, the prompt). A candidate that ends (EOS, or the max_tokens-th token) and ranks
in the top beam_width becomes a finished hypothesis scored
`cum_logprob / num_generated_tokens ** length_penalty` (EOS counted); the best beam_width
others continue. `early_stopping` decides when the search ends (see BeamSearchParams).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from tqdm.auto import tqdm

from octavo.core.request import Request, RequestStatus
from octavo.core.stop import StopChecker
from octavo.outputs import BeamSearchOutput, BeamSearchSequence, Logprob
from octavo.param_checks import as_float, as_int, check
from octavo.sampling_params import SamplingParams

if TYPE_CHECKING:
    from octavo.engine.engine import Engine

MAX_BEAM_WIDTH = 128
EarlyStopping = bool | Literal["never"]


def _score(cum_logprob: float, length: int, length_penalty: float) -> float:
    """HF's `cum_logprob / length ** length_penalty`, without an exception where the power
    leaves the float range (|length_penalty| in the hundreds): it is taken as inf or 0, so
    such a penalty scores every hypothesis -0.0 or -inf and they tie."""
    try:
        scale = float(length) ** length_penalty
    except OverflowError:
        scale = math.inf
    if scale == 0.0:
        return -math.inf if cum_logprob < 0 else 0.0
    return cum_logprob / scale


@dataclass
class BeamSearchParams:
    """Beam search settings: vLLM's fields, plus HF's `early_stopping`.

    - `temperature` is accepted for vLLM compatibility and changes nothing: candidates are
      ranked by raw log-probs, as with HF's `do_sample=False` and vLLM v1's raw logprobs.
    - `length_penalty` is the exponent of the generated length in the score (HF's).
    - `early_stopping` (HF's semantics; default False, HF's default): True ends a prompt's
      search once it has beam_width finished hypotheses; False once the best running beam,
      scored at its current length, cannot beat the worst of them; "never" likewise but
      scored at max_tokens when length_penalty > 0 (the best it could ever reach).
    - `include_stop_str_in_output` keeps the EOS token's text in `text`.

    Raises ValueError naming the field for any invalid value, at construction and again when
    a search starts (`validate`), so a field assigned in between is checked too.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: EarlyStopping = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Checks every field, normalizing as at construction."""
        allowed = f"an integer in [1, {MAX_BEAM_WIDTH}]"
        self.beam_width = as_int("beam_width", self.beam_width, allowed, 1, MAX_BEAM_WIDTH)
        self.max_tokens = as_int("max_tokens", self.max_tokens, "an integer >= 1", lo=1)
        for name in ("ignore_eos", "include_stop_str_in_output"):
            check(isinstance(getattr(self, name), bool), name, "a bool", getattr(self, name))
        self.temperature = as_float("temperature", self.temperature, "a number >= 0", lo=0)
        self.length_penalty = as_float("length_penalty", self.length_penalty, "a finite number")
        value = self.early_stopping
        check(value in (True, False, "never"), "early_stopping", "True, False or 'never'", value)


@dataclass
class _Beam:
    """A live beam: its request, accumulated log-prob, and its latest report."""

    request: Request  # finished while parked; its tokens stay valid
    cum_logprob: float
    logprobs: list[dict[int, Logprob]]
    # The top-K (token, log-prob, rank) of the next token; None until the beam reports.
    report: list[tuple[int, float, int]] | None = None
    parked: bool = False  # its request was finished to free KV; it has reported


@dataclass
class _Candidate:
    beam: _Beam
    token_id: int
    cum_logprob: float
    finish_reason: str | None  # "stop" (EOS), "length", or None: it may continue


@dataclass
class BeamSearchInstance:
    """One prompt's search: its live beams and its best finished hypotheses, HF's rules."""

    params: BeamSearchParams
    root: Request  # the prompt's first beam; forks are named after it
    stops: StopChecker  # the engine's: EOS ids and the context limit
    live: list[_Beam] = field(default_factory=list)  # best first
    finished: list[BeamSearchSequence] = field(default_factory=list)  # best first
    num_generated: int = 0
    improvable: bool = True  # HF's is_early_stop_heuristic_unsatisfied
    done: bool = False

    @property
    def ready(self) -> bool:
        """Whether every live beam has reported its next-token candidates."""
        return all(beam.report is not None for beam in self.live)

    def __post_init__(self) -> None:
        if not self.live:
            self.live = [_Beam(self.root, 0.0, [])]

    def advance(self) -> list[_Candidate]:
        """Runs one selection step over the reports. Returns the candidates that continue,
        best first (empty once the search is done); updates `finished` and `done`."""
        assert self.ready and not self.done, "advance before every live beam reported"
        width, step = self.params.beam_width, self.num_generated + 1
        candidates = self._top_candidates(step)
        # HF decides both of these from the state before this step's hypotheses are added.
        full = len(self.finished) == width
        if self.improvable and not (full and self.params.early_stopping is True):
            for cand in candidates[:width]:
                if cand.finish_reason is not None:
                    self._add_hypothesis(cand, step)
        chosen = [c for c in candidates if c.finish_reason is None][:width]
        self.num_generated = step
        if len(self.finished) == width and chosen:
            self.improvable = self._best_possible(chosen[0], step) > self.finished[-1].score
        self.done = (
            not chosen
            or not self.improvable
            or (self.params.early_stopping is True and len(self.finished) == width)
        )
        return [] if self.done else chosen

    def _top_candidates(self, step: int) -> list[_Candidate]:
        k = num_candidates(self.params, len(self.stops.eos_token_ids))
        candidates = [
            (beam.cum_logprob + logprob, beam, token)
            for beam in self.live
            for token, logprob, _ in beam.report[:k]  # type: ignore[index]
        ]
        # NOTE: a stable sort keeps ties in beam order, then rank order.
        candidates.sort(key=lambda c: -c[0])
        return [
            _Candidate(beam, token, cum, self._finish_reason(token, step))
            for cum, beam, token in candidates[:k]
        ]

    def _finish_reason(self, token: int, step: int) -> str | None:
        """ "stop" (EOS), "length" (max_tokens or the context limit) or None, by the engine's
        stop rules for the candidate `token` as the step-th output token."""
        status, _ = self.stops.token_status(
            token, step, self.root.num_prompt_tokens,
            ignore_eos=self.params.ignore_eos, max_tokens=self.params.max_tokens,
        )  # fmt: skip
        return None if status is None else status.finish_reason

    def _add_hypothesis(self, cand: _Candidate, step: int) -> None:
        beam = cand.beam
        hypothesis = BeamSearchSequence(
            tokens=beam.request.all_token_ids + [cand.token_id],
            logprobs=beam.logprobs + [_logprob_dict(beam.report)],  # type: ignore[arg-type]
            cum_logprob=cand.cum_logprob,
            score=_score(cand.cum_logprob, step, self.params.length_penalty),
            finish_reason=cand.finish_reason,
        )
        # NOTE: stable: on a tie, a hypothesis found earlier stays ahead (HF's merge order).
        self.finished.append(hypothesis)
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[self.params.beam_width :]

    def _best_possible(self, best_running: _Candidate, step: int) -> float:
        """HF's guess at the best score the running beams can still reach."""
        penalty = self.params.length_penalty
        never = self.params.early_stopping == "never" and penalty > 0
        return _score(best_running.cum_logprob, self.params.max_tokens if never else step, penalty)

    def output(self, tokenizer) -> BeamSearchOutput:
        """The finished hypotheses, best first, with their text (None without a tokenizer)."""
        for seq in self.finished:
            seq.text = _decode(tokenizer, seq, self.root.num_prompt_tokens, self.params)
        return BeamSearchOutput(list(self.finished))


def num_candidates(params: BeamSearchParams, num_eos_ids: int) -> int:
    """HF's beams_to_keep: candidates kept per step, enough that beam_width beams can go on
    even if all the best ones end with one of the model's `num_eos_ids` EOS ids."""
    num_eos = 0 if params.ignore_eos else num_eos_ids
    return max(2, 1 + num_eos) * params.beam_width


# ---- the driver -------------------------------------------------------------------------


def beam_search(
    engine: Engine,
    prompts: Sequence[str | list[int]],
    params: BeamSearchParams,
    use_tqdm: bool = False,
    id_prefix: str = "beam",
) -> list[BeamSearchOutput]:
    """Beam search for all prompts together: the beams of every prompt share each step.

    Args:
        engine: an engine with no other requests; its scheduler and runner are driven
            directly.
        prompts: text or token ids, one per search.
        params: the search settings.
        use_tqdm: show a progress bar over prompts.
        id_prefix: beams are requests `{id_prefix}-{i}` and `{id_prefix}-{i}.{n}`.

    Returns:
        One BeamSearchOutput per prompt, in order.

    Raises:
        ValueError: bad params or a bad prompt (nothing is left queued then).
        RuntimeError: the engine is busy, or its KV cache cannot hold a single beam.
    """
    if not isinstance(params, BeamSearchParams):
        kind = type(params).__name__
        raise ValueError(f"params must be BeamSearchParams, got {kind}")  # noqa: TRY004
    params.validate()  # again: a field may have been assigned since construction
    if engine.has_unfinished_requests():
        raise RuntimeError("beam search needs an engine with no other requests")
    instances = _add_prompts(engine, prompts, params, id_prefix)
    beams = {inst.root.request_id: inst.live[0] for inst in instances}
    new_ids = itertools.count(1)
    bar = tqdm(total=len(instances), desc="Beam search", disable=not use_tqdm)
    try:
        while not all(inst.done for inst in instances):
            _park(engine, beams, RequestStatus.PREEMPTED)  # idle anyway: skip the recompute
            if not _step(engine, beams) and not _park(engine, beams, RequestStatus.RUNNING):
                raise RuntimeError("beam search stalled: the KV cache cannot hold one beam")
            for inst in instances:
                if not inst.done and inst.ready:
                    _apply(engine, inst, inst.advance(), beams, new_ids)
                    if inst.done:
                        bar.update(1)
    except BaseException:
        _release(engine, instances, beams)
        engine.reset_prefix_cache()  # blocks cached by a failed step may hold garbage
        raise
    finally:
        bar.close()
    _release(engine, instances, beams)
    return [inst.output(engine.tokenizer) for inst in instances]


def _add_prompts(
    engine: Engine, prompts: Sequence[str | list[int]], params: BeamSearchParams, id_prefix: str
) -> list[BeamSearchInstance]:
    stops = engine.scheduler.stops
    # NOTE: a wide search needs more top log-probs than users may ask for (MAX_LOGPROBS);
    # the sampler takes any number.
    candidates = num_candidates(params, len(stops.eos_token_ids))
    sampling = SamplingParams(temperature=0, ignore_eos=True, max_tokens=None, logprobs=0)
    sampling.logprobs = candidates
    instances: list[BeamSearchInstance] = []
    try:
        for i, prompt in enumerate(prompts):
            root = engine.add_request(prompt, sampling, f"{id_prefix}-{i}", max_logprobs=candidates)
            instances.append(BeamSearchInstance(params, root, stops))
    except ValueError:
        engine.abort_request([inst.root.request_id for inst in instances])
        raise
    return instances


def _step(engine: Engine, beams: dict[str, _Beam]) -> bool:
    """One forward pass over every beam that is behind; stores the reports of the beams
    that reached their last token. False if nothing could be scheduled."""
    reports = engine.report_step()
    if reports is None:
        return False
    for request_id, entries in reports.items():
        # entries: the (greedy) sampled token, then the top-K by raw log-prob.
        beams[request_id].report = entries[1:]
    return True


def _park(engine: Engine, beams: dict[str, _Beam], status: RequestStatus) -> bool:
    """Finishes the requests of the reported beams in `status`, freeing their KV; returns
    whether any was parked. NOTE: a parked beam's tokens and report stay valid."""
    parked = [b for b in beams.values() if b.report is not None and b.request.status == status]
    _drop(engine, parked, beams)
    for beam in parked:
        beam.parked = True
    return bool(parked)


def _apply(
    engine: Engine,
    inst: BeamSearchInstance,
    chosen: list[_Candidate],
    beams: dict[str, _Beam],
    new_ids: itertools.count,
) -> None:
    """Makes the chosen candidates the live beams. Unpicked beams are finished (their blocks
    freed); a beam picked k times is forked k - 1 times, before its own new token is
    appended, since a fork copies the parent's tokens. A parked beam is forked k times."""
    picked = {id(c.beam) for c in chosen}
    _drop(engine, [b for b in inst.live if id(b) not in picked], beams)
    step_logprobs = {id(b): _logprob_dict(b.report) for b in inst.live if id(b) in picked}
    live: list[_Beam] = []
    extends: list[_Candidate] = []  # the first pick of each parent extends the parent
    for cand in chosen:
        parent = cand.beam
        if not parent.parked and all(c.beam is not parent for c in extends):
            extends.append(cand)
            live.append(parent)
            continue
        child_id = f"{inst.root.request_id}.{next(new_ids)}"
        request = engine.fork_sequence(parent.request, child_id)
        engine.append_token(request, cand.token_id)
        logprobs = parent.logprobs + [step_logprobs[id(parent)]]
        live.append(beams.setdefault(child_id, _Beam(request, cand.cum_logprob, logprobs)))
    for cand in extends:
        beam = cand.beam
        engine.append_token(beam.request, cand.token_id)
        beam.cum_logprob = cand.cum_logprob
        beam.logprobs.append(step_logprobs[id(beam)])
        beam.report = None
    inst.live = live


def _drop(engine: Engine, dropped: list[_Beam], beams: dict[str, _Beam]) -> None:
    for beam in dropped:
        engine.finish_sequence(beam.request)
        beams.pop(beam.request.request_id, None)


def _release(engine: Engine, instances: list[BeamSearchInstance], beams: dict[str, _Beam]) -> None:
    """Frees every beam still live, and forgets the roots' output state."""
    for inst in instances:
        _drop(engine, inst.live, beams)
        inst.live = []
    # NOTE: the roots are finished by now; aborting them only drops the output processor's
    # record of them (forks were never registered there).
    engine.abort_request([inst.root.request_id for inst in instances])


def _logprob_dict(report: list[tuple[int, float, int]] | None) -> dict[int, Logprob]:
    return {token: Logprob(logprob, rank) for token, logprob, rank in report or []}


def _decode(tokenizer, seq: BeamSearchSequence, prompt_len: int, params: BeamSearchParams):
    if tokenizer is None:
        return None
    generated = seq.tokens[prompt_len:]
    eos = generated[-1:] if seq.finish_reason == "stop" else []
    text = tokenizer.decode(generated[: len(generated) - len(eos)], skip_special_tokens=True)
    if eos and params.include_stop_str_in_output:
        text += tokenizer.decode(eos)
    return text
