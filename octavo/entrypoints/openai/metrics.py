"""Prometheus metrics of one server, in a registry of its own (several servers may share a
process, as in the tests).

Per request (observed by the serving code): outcome, time to first token, time per output
token after the first, end-to-end latency, prompt and generated tokens. Engine state (read
from the engine loop's stats snapshot at scrape time): whether it is up, running and waiting
requests, KV blocks, prefix-cache hit rate, preemptions; while it is down, only that.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from octavo.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class ServerMetrics:
    """The metrics of one server; `render()` is the body of GET /metrics."""

    def __init__(
        self,
        engine_stats: Callable[[], dict[str, int | float | str] | None],
        engine_restarts: Callable[[], int] = lambda: 0,
    ) -> None:
        """`engine_stats` gives the engine's stats snapshot, or None while it is down;
        `engine_restarts` how many times the engine was started again after it died."""
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "octavo_requests",
            "Finished requests by outcome: the finish reason (stop, length, abort) or error",
            ["outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "octavo_time_to_first_token_seconds",
            "Time from arrival to the first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "octavo_time_per_output_token_seconds",
            "Mean time per generated token after the first, per request",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "octavo_e2e_request_latency_seconds",
            "Time from arrival to the last generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("octavo_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("octavo_generation_tokens", "Generated tokens", registry=r)
        r.register(_EngineStatsCollector(engine_stats, engine_restarts))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def count_error(self) -> None:
        self.requests.labels(outcome="error").inc()

    def start_request(self) -> RequestTimer:
        return RequestTimer(self)


class RequestTimer:
    """Times one engine request from arrival to `finish`, which records it. It reads the
    request's DELTA outputs (what is new since the last), as the server asks for them."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.arrival = time.perf_counter()
        self.first_token: float | None = None
        self.num_prompt_tokens: int | None = None  # None until the first output
        self.num_tokens: dict[int, int] = {}  # completion index -> tokens so far
        self.finish_reasons: dict[int, str] = {}
        self.finished = False

    def observe(self, out: RequestOutput) -> None:
        if self.first_token is None and any(c.token_ids for c in out.outputs):
            self.first_token = time.perf_counter()
            self.metrics.ttft.observe(self.first_token - self.arrival)
        self.num_prompt_tokens = len(out.prompt_token_ids)
        for c in out.outputs:
            self.num_tokens[c.index] = self.num_tokens.get(c.index, 0) + len(c.token_ids)
            if c.finish_reason is not None:
                self.finish_reasons[c.index] = c.finish_reason
        self.finished = out.finished

    def finish(self, outcome: str | None = None) -> None:
        """Records the request; `outcome` defaults to the first completion's finish reason."""
        m = self.metrics
        if outcome is None:
            first = min(self.finish_reasons, default=None)
            outcome = "abort" if first is None else self.finish_reasons[first]
        m.requests.labels(outcome=outcome).inc()
        if self.num_prompt_tokens is None:
            return
        e2e = time.perf_counter() - self.arrival
        m.e2e.observe(e2e)
        m.prompt_tokens.inc(self.num_prompt_tokens)
        m.generation_tokens.inc(sum(self.num_tokens.values()))
        longest = max(self.num_tokens.values(), default=0)
        if self.first_token is not None and longest > 1:
            m.tpot.observe((e2e - (self.first_token - self.arrival)) / (longest - 1))


@dataclass(eq=False)  # hashed as itself: the registry keys its collectors by them
class _EngineStatsCollector:
    """Turns the engine's stats snapshot into gauges and counters at scrape time."""

    engine_stats: Callable[[], dict[str, int | float | str] | None]
    engine_restarts: Callable[[], int]

    def describe(self):
        return []  # unchecked collector: names are not reserved in the registry

    def collect(self):
        s = self.engine_stats()
        up = 0 if s is None else 1
        yield GaugeMetricFamily("octavo_engine_up", "1 while the engine runs, else 0", up)
        yield CounterMetricFamily(
            "octavo_engine_restarts",
            "Times the engine process was started again after it died",
            value=self.engine_restarts(),
        )
        if s is None:  # a dead engine's last snapshot would show requests it no longer has
            return
        total, free = s.get("kv_blocks_total", 0), s.get("kv_blocks_free", 0)
        queries, hits = s.get("prefix_cache_queries", 0), s.get("prefix_cache_hits", 0)
        for name, doc, value in (
            ("octavo_num_requests_running", "Requests in the running batch",
             s.get("num_requests_running", 0)),
            ("octavo_num_requests_waiting", "Requests waiting to be scheduled",
             s.get("num_requests_waiting", 0)),
            ("octavo_kv_blocks_total", "KV cache blocks in the pool", total),
            ("octavo_kv_blocks_used", "KV cache blocks in use", total - free),
            ("octavo_kv_cache_usage", "Fraction of KV cache blocks in use",
             (total - free) / total if total else 0.0),
            ("octavo_prefix_cache_hit_rate",
             "Prompt tokens found in the prefix cache / prompt tokens looked up",
             hits / queries if queries else 0.0),
        ):  # fmt: skip
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, key in (
            ("octavo_num_preemptions", "Requests preempted (by recompute)", "num_preemptions"),
            ("octavo_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
             "prefix_cache_queries"),
            ("octavo_prefix_cache_hits", "Prompt tokens found in the prefix cache",
             "prefix_cache_hits"),
            ("octavo_engine_steps", "Engine steps run", "num_steps"),
        ):  # fmt: skip
            yield CounterMetricFamily(name, doc, value=s.get(key, 0))
        if "spec_num_drafts" in s:
            yield from _speculation_metrics(s)
        if "moe_expert_tokens" in s:
            yield from _expert_metrics(s)


def _expert_metrics(s: dict):
    tokens = CounterMetricFamily(
        "octavo_moe_expert_tokens", "Tokens routed to each expert, over all MoE layers",
        labels=["expert"],
    )  # fmt: skip
    for expert, count in enumerate(s["moe_expert_tokens"]):
        tokens.add_metric([str(expert)], count)
    yield tokens
    yield GaugeMetricFamily(
        "octavo_moe_expert_imbalance",
        "The most loaded expert of any MoE layer over that layer's mean (1: even)",
        value=s["moe_expert_imbalance"],
    )


def _speculation_metrics(s: dict):
    """Speculative decoding's counters, with vLLM's meaning: verify steps, guesses
    checked and kept, and kept by position (of the step's guesses)."""
    for name, doc, key in (
        ("octavo_spec_decode_num_drafts", "Steps of a request that verified guesses",
         "spec_num_drafts"),
        ("octavo_spec_decode_num_draft_tokens", "Guessed tokens verified", "spec_draft_tokens"),
        ("octavo_spec_decode_num_accepted_tokens", "Guessed tokens kept", "spec_accepted_tokens"),
    ):  # fmt: skip
        yield CounterMetricFamily(name, doc, value=s[key])
    by_position = CounterMetricFamily(
        "octavo_spec_decode_num_accepted_tokens_per_pos",
        "Guessed tokens kept, by their position in the step's guesses",
        labels=["position"],
    )
    for position, count in enumerate(s["spec_accepted_per_position"]):
        by_position.add_metric([str(position)], count)
    yield by_position
