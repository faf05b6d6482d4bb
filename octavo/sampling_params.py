"""SamplingParams: how to pick each next token and when to stop, validated at construction."""

from __future__ import annotations

import copy
import enum
import math
from collections.abc import Callable
from dataclasses import dataclass

from octavo.param_checks import as_float, as_int, as_list, check, to_float

GREEDY_TEMPERATURE = 1e-5  # a temperature below this means greedy
MAX_LOGPROBS = 20  # the most top log-probs a request may ask for per token
MAX_N = 128  # the most completions one request may ask for
MAX_LOGIT_BIAS = 100.0  # the largest logit bias (OpenAI's range is [-100, 100])
BAN_LOGIT_BIAS = -1e20  # a logit bias at or below this bans its token (-inf)
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32
FLOAT32_MAX = 3.4028234663852886e38
MAX_TEMPERATURE = 1e38  # log2(e) / 1e38 = 1.44e-38, above float32's smallest normal 1.18e-38


class RequestOutputKind(enum.Enum):
    """What each of a request's outputs holds (vLLM's names and meanings)."""

    CUMULATIVE = 0  # everything so far: text, token ids and log-probs
    DELTA = 1  # only what is new since the request's previous output
    FINAL_ONLY = 2  # one output, when the request finishes


class SamplingType(enum.Enum):
    """How the sampler picks a row's token."""

    GREEDY = enum.auto()  # argmax of the (penalized) logits
    RANDOM = enum.auto()  # drawn with the engine's shared generator
    RANDOM_SEED = enum.auto()  # drawn with noise derived from the request's own seed


@dataclass
class StructuredOutputsParams:
    """vLLM's structured outputs: the text the request generates must match exactly one of

    json          a JSON schema (a dict or its JSON text)
    json_object   True: any JSON object
    regex         a regular expression (Rust's regex syntax)
    choice        one of a list of strings
    grammar       a grammar, in Lark or GBNF (llama.cpp's) syntax

    `disable_any_whitespace` keeps JSON free of whitespace between tokens beyond what the
    schema needs (by default a model may put spaces and newlines there, as in vLLM). The
    engine compiles the constraint with llguidance when it takes the request.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """ValueError unless exactly one constraint is given, with a value of its type."""
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            found = ", ".join(given) or "none"
            raise ValueError(
                f"structured_outputs needs exactly one of {', '.join(_CONSTRAINTS)}; got {found}"
            )
        kinds = {"json": (str, dict), "regex": (str,), "grammar": (str,), "json_object": (bool,)}
        name = given[0]
        if name == "choice":
            ok = isinstance(self.choice, (list, tuple)) and bool(self.choice)
            ok = ok and all(isinstance(c, str) for c in self.choice)
            check(ok, "structured_outputs.choice", "a non-empty list of strings", self.choice)
            self.choice = list(self.choice)
        else:
            value = getattr(self, name)
            check(isinstance(value, kinds[name]), f"structured_outputs.{name}",
                   " or ".join(k.__name__ for k in kinds[name]), value)  # fmt: skip
        check(isinstance(self.disable_any_whitespace, bool),
               "structured_outputs.disable_any_whitespace", "a bool", self.disable_any_whitespace)  # fmt: skip


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class SamplingParams:
    """Sampling and stopping settings of one request, with vLLM's fields and defaults.

    `temperature` 0 means greedy. `top_k` None disables top-k (0 and vLLM's -1 are accepted
    and normalized to None). `stop` becomes a list of strings and `stop_token_ids` a list of
    ints. Every invalid value raises ValueError naming the field and the allowed values.

    Validation runs at construction and again when an engine takes the request
    (`validate`), so a field assigned in between is checked too.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: str | list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, max_logprobs: int = MAX_LOGPROBS) -> None:
        """Checks every field, normalizing as at construction; raises ValueError naming
        the first bad one. `max_logprobs` is the most top log-probs allowed (beam search
        asks the engine for more than users may)."""
        self.__dict__.pop("_shaping_tensors", None)  # the sampler's copy of two fields below
        self.__dict__.pop("_bad_words_token_ids", None)  # the engine's encoding of bad_words
        self._validate_sampling()
        self._validate_stopping()
        self._validate_outputs(max_logprobs)

    def _validate_sampling(self) -> None:
        self.n = as_int("n", self.n, f"an integer in [1, {MAX_N}]", lo=1, hi=MAX_N)
        # The sampler scales float32 logits by log2(e) / temperature, which must stay a
        # normal float32: at 0 (a flushed subnormal) or inf a banned -inf logit becomes NaN,
        # which no ban or grammar survives.
        allowed = f"a number in [0, {MAX_TEMPERATURE:.0e}]"
        self.temperature = as_float(
            "temperature", self.temperature, allowed, lo=0, hi=MAX_TEMPERATURE
        )
        self.top_p = as_float("top_p", self.top_p, "a number in (0, 1]", hi=1)
        check(self.top_p > 0, "top_p", "a number in (0, 1]", self.top_p)
        if self.top_k is not None:
            allowed = "a positive integer, or None / 0 / -1 to disable"
            top_k = as_int("top_k", self.top_k, allowed, lo=-1)
            self.top_k = None if top_k in (0, -1) else top_k
        self.min_p = as_float("min_p", self.min_p, "a number in [0, 1]", lo=0, hi=1)
        if self.seed is not None:
            self.seed = as_int("seed", self.seed, "an integer or None")
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, as_float(name, getattr(self, name), "in [-2, 2]", lo=-2, hi=2))
        # The sampler applies it in float32: values outside float32's normal range are refused.
        allowed = f"a number in [{FLOAT32_TINY:.4g}, {FLOAT32_MAX:.4g}] (> 0, float32's range)"
        self.repetition_penalty = as_float(
            "repetition_penalty", self.repetition_penalty, allowed, lo=FLOAT32_TINY, hi=FLOAT32_MAX
        )
        if self.logit_bias is not None:
            # Any negative bias, -inf included, bans a token in effect; a positive one is
            # capped so that a biased logit over a small temperature stays finite.
            allowed = f"a dict of token ids (integers >= 0) to numbers <= {MAX_LOGIT_BIAS}"
            check(isinstance(self.logit_bias, dict), "logit_bias", allowed, self.logit_bias)
            self.logit_bias = {
                as_int("logit_bias", t, allowed, lo=0): _as_bias(v, allowed)
                for t, v in self.logit_bias.items()
            }
        if self.allowed_token_ids is not None:
            allowed = "a non-empty list of token ids (integers >= 0), or None"
            ids = as_list("allowed_token_ids", self.allowed_token_ids, allowed, allow_str=False)
            check(bool(ids), "allowed_token_ids", allowed, self.allowed_token_ids)
            ids = [as_int("allowed_token_ids", t, allowed, lo=0) for t in ids]
            self.allowed_token_ids = list(dict.fromkeys(ids))  # a set: repeats say nothing
        if self.structured_outputs is not None:
            spec = self.structured_outputs
            allowed = "a StructuredOutputsParams or None"
            check(isinstance(spec, StructuredOutputsParams), "structured_outputs", allowed, spec)
            spec.validate()
        allowed = "a string with a non-space character, or a list of them"
        self.bad_words = as_list("bad_words", self.bad_words, allowed)
        for word in self.bad_words:
            check(isinstance(word, str) and word.strip() != "", "bad_words", allowed, word)

    def _validate_stopping(self) -> None:
        if self.max_tokens is not None:
            allowed = "an integer >= 1, or None for the context limit"
            self.max_tokens = as_int("max_tokens", self.max_tokens, allowed, lo=1)
        self.min_tokens = as_int("min_tokens", self.min_tokens, "an integer >= 0", lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        self.stop = as_list("stop", self.stop, "a non-empty string or a list of them")
        for s in self.stop:
            check(isinstance(s, str) and s != "", "stop", "non-empty strings", s)
        allowed = "a list of integers >= 0"
        ids = as_list("stop_token_ids", self.stop_token_ids, allowed, allow_str=False)
        ids = [as_int("stop_token_ids", t, allowed, lo=0) for t in ids]
        self.stop_token_ids = list(dict.fromkeys(ids))  # a set: repeats say nothing
        for name in ("include_stop_str_in_output", "ignore_eos"):
            check(isinstance(getattr(self, name), bool), name, "a bool", getattr(self, name))

    def _validate_outputs(self, max_logprobs: int) -> None:
        allowed = f"an integer in [0, {max_logprobs}] or None"
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                value = as_int(name, getattr(self, name), allowed, lo=0, hi=max_logprobs)
                setattr(self, name, value)
        if self.truncate_prompt_tokens is not None:
            allowed = "an integer >= 1, -1 for max_model_len, or None"
            value = as_int("truncate_prompt_tokens", self.truncate_prompt_tokens, allowed, lo=-1)
            check(value != 0, "truncate_prompt_tokens", allowed, value)
            self.truncate_prompt_tokens = value
        for name in ("skip_special_tokens", "detokenize"):
            check(isinstance(getattr(self, name), bool), name, "a bool", getattr(self, name))
        if self.stop and not self.detokenize:
            raise ValueError("detokenize must be True for stop strings, which match text")
        value = self.output_kind
        check(isinstance(value, RequestOutputKind), "output_kind", "a RequestOutputKind", value)

    @property
    def sampling_type(self) -> SamplingType:
        """GREEDY when temperature < 1e-5, else RANDOM_SEED with a seed, else RANDOM."""
        if self.temperature < GREEDY_TEMPERATURE:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def is_greedy(self) -> bool:
        """Whether the token is the argmax of the (penalized) logits."""
        return self.sampling_type is SamplingType.GREEDY

    def set_eos_token_ids(self, eos_token_ids: tuple[int, ...]) -> None:
        """The engine's: the model's EOS ids (its StopChecker's), which stop this request
        unless ignore_eos (`all_stop_token_ids`), as vLLM's update_from_generation_config."""
        self.__dict__["_eos_token_ids"] = eos_token_ids

    @property
    def all_stop_token_ids(self) -> set[int]:
        """The ids that stop this request from min_tokens on, and that the sampler bans
        until then: stop_token_ids, and the model's EOS ids unless ignore_eos."""
        eos = () if self.ignore_eos else self.__dict__.get("_eos_token_ids", ())
        return set(self.stop_token_ids) | set(eos)

    def check_token_ids(self, vocab_size: int) -> None:
        """What only a model can check: the token ids of logit_bias and allowed_token_ids
        lie in its vocabulary, and logit_bias, bad_words (once encoded) and min_tokens leave
        an allowed token to sample. Raises ValueError naming the field."""
        for name, ids in (
            ("logit_bias", self.logit_bias or ()),
            ("allowed_token_ids", self.allowed_token_ids or ()),
        ):
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise ValueError(
                    f"{name} names token id {bad}, outside the vocabulary [0, {vocab_size})"
                )
        if self.allowed_token_ids:
            banned = {t for t, bias in (self.logit_bias or {}).items() if bias == -math.inf}
            encoded = self.__dict__.get("_bad_words_token_ids") or ()
            banned |= {ids[0] for ids in encoded if len(ids) == 1}  # banned everywhere
            if self.min_tokens:
                banned |= self.all_stop_token_ids
            if set(self.allowed_token_ids) <= banned:
                raise ValueError(
                    "allowed_token_ids holds only tokens that logit_bias or bad_words ban, or EOS "
                    "and stop ids that min_tokens forbids until it is reached: no token could be "
                    "sampled"
                )

    def encode_bad_words(self, encode: Callable[[str], list[int]], vocab_size: int) -> None:
        """Encodes bad_words as vLLM does, for the sampler (`bad_words_token_ids`).

        Each word, leading spaces dropped, is one entry. With one space in front, it is a
        second entry where that encodes to a different first token and as many tokens (the
        word inside a text rather than at its start). `encode` gives a text's ids without
        special tokens. ValueError for an id outside [0, vocab_size)."""
        entries: list[list[int]] = []
        for word in self.bad_words:
            ids = list(encode(word.lstrip()))
            if not ids:
                raise ValueError(f"bad_words holds {word!r}, which encodes to no tokens")
            entries.append(ids)
            spaced = list(encode(" " + word.lstrip()))
            if spaced and spaced[0] != ids[0] and len(spaced) == len(ids):
                entries.append(spaced)
        bad = next((t for ids in entries for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"bad_words encode to token id {bad}, outside the vocabulary [0, {vocab_size})"
            )
        self.__dict__["_bad_words_token_ids"] = entries

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """bad_words as token id sequences (see encode_bad_words); [] without bad words.
        ValueError if they were set but not encoded: only an engine has the tokenizer."""
        if not self.bad_words:
            return []
        entries = self.__dict__.get("_bad_words_token_ids")
        if entries is None:
            raise ValueError("bad_words must be encoded first (SamplingParams.encode_bad_words)")
        return entries

    @property
    def needs_output_token_ids(self) -> bool:
        """Whether the sampler reads the request's earlier tokens on the host: penalties
        count them, and a bad word of several tokens matches its start against them (a
        structured output's grammar takes them in the engine)."""
        if self.has_penalties:
            return True
        entries = self.__dict__.get("_bad_words_token_ids")
        if entries is None:  # not encoded yet: any word may have several tokens
            return bool(self.bad_words)
        return any(len(ids) > 1 for ids in entries)

    def prompt_tokens_kept(self, max_model_len: int) -> int | None:
        """How many prompt tokens truncate_prompt_tokens keeps, the last ones (max_model_len
        for -1); None to keep them all. A text prompt keeps its special tokens (see
        `encode_text`)."""
        keep = self.truncate_prompt_tokens
        return max_model_len if keep == -1 else keep

    def samples_from_settings_alone(self, num_output_tokens: int) -> bool:
        """Whether the sampler's metadata for this request follows from its settings alone
        from now on, whatever tokens come, given `num_output_tokens` earlier outputs: no bad
        words or penalties, and min_tokens reached (EOS is banned until then). A seed's
        noise, which the runner keys by the number of outputs, and a structured output's
        mask, which follows its grammar, are made each step apart."""
        return (
            num_output_tokens >= self.min_tokens and not self.bad_words and not self.has_penalties
        )

    @property
    def has_penalties(self) -> bool:
        """Whether any of presence, frequency or repetition penalty changes the logits."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    def clone(self) -> SamplingParams:
        """A deep copy: changing the copy's lists leaves this one unchanged."""
        return copy.deepcopy(self)

    def for_sample(self, index: int) -> SamplingParams:
        """The settings of completion `index` of an n > 1 request: n = 1 and, with a seed,
        seed + index, as vLLM gives them. So the n samples are reproducible and differ from
        each other, and sample i is what an n = 1 request with seed + i would draw."""
        # NOTE: a shallow copy: the engine never changes a request's lists and dicts, and a
        # deep copy of a vocabulary-wide allowed_token_ids would be slow for every sample.
        child = copy.copy(self)
        child.n = 1
        if self.seed is not None:
            child.seed = self.seed + index
        return child


def _as_bias(value: object, allowed: str) -> float:
    """A logit bias as a float; one at or below BAN_LOGIT_BIAS is a ban: -inf."""
    result = to_float(value)
    check(result <= MAX_LOGIT_BIAS, "logit_bias", allowed, value)  # NaN fails too
    return -math.inf if result <= BAN_LOGIT_BIAS else result
