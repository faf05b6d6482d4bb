"""`octavo bench serve`: an online serving benchmark against any OpenAI-compatible server.

Requests arrive as a Poisson process at `--request-rate` per second (`inf`: all at once), each
a streaming POST /v1/completions of synthetic random text or token ids, with lengths as in
vLLM's random dataset. The metrics are vLLM's `bench serve` ones:

    TTFT  time from sending to the first streamed chunk with a choice in it
    TPOT  (latency - TTFT) / (output tokens - 1), per request: the first token excluded
    ITL   every gap between two such chunks, pooled over all requests

A chunk counts even when its text is empty (a special token, a model without a tokenizer), as
in vLLM. Output tokens come from the server's usage (stream_options.include_usage), else from
the number of chunks. `ignore_eos` is sent as a vLLM-style extra field so that every request
produces exactly --max-tokens tokens (--no-ignore-eos for servers that reject it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field

from octavo.entrypoints.cli_args import positive_int

_TEXT = (
    "time person year way day thing man world life hand part child eye woman place work week "
    "case point government company number group problem fact be have do say get make go know "
    "take see come think look want give use find tell ask seem feel try leave call good new "
    "first last long great little own other old right big high different small large next "
    "early young important few public bad same able river mountain garden kitchen window "
    "music story letter market summer winter morning evening ocean forest city village road"
)
_WORDS = _TEXT.split()


@dataclass
class RequestResult:
    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


def synthetic_prompts(
    num_prompts: int,
    input_len: int,
    seed: int,
    range_ratio: float = 0.0,
    token_ids: int | None = None,
) -> list[str] | list[list[int]]:
    """Random prompts from a fixed seed (no dataset needed): sentences of that many words, or
    lists of ids below `token_ids`. Lengths are uniform over input_len x (1 -/+ range_ratio)."""
    rng = random.Random(seed)
    low = max(1, round(input_len * (1 - range_ratio)))
    high = max(low, round(input_len * (1 + range_ratio)))
    lengths = [rng.randint(low, high) if high > low else low for _ in range(num_prompts)]
    if token_ids is not None:
        return [[rng.randrange(token_ids) for _ in range(n)] for n in lengths]
    return [" ".join(rng.choice(_WORDS) for _ in range(n)) for n in lengths]


async def send_request(client, url: str, payload: dict, headers: dict) -> RequestResult:
    """Sends one streaming completion and times its chunks."""
    result = RequestResult()
    chunks = 0
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"].get("completion_tokens", 0)
                    result.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
    except Exception as e:  # noqa: BLE001 - a benchmark reports failures, it goes on
        result.error = repr(e)
        return result
    result.latency = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks
    result.ok = chunks > 0
    return result


async def run_benchmark(args: argparse.Namespace) -> dict:
    """Runs the whole benchmark and returns its metrics."""
    import httpx
    from tqdm.auto import tqdm

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(100, args.num_prompts))
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        model = args.model or await _first_model(client, args.base_url, headers)
        url = args.base_url.rstrip("/") + args.endpoint
        prompts = synthetic_prompts(
            args.num_prompts, args.input_len, args.seed, args.random_range_ratio, args.token_ids
        )
        payloads = [_payload(args, model, p) for p in prompts]
        print("warming up: one request before the timed run", file=sys.stderr, flush=True)
        warmup = await send_request(client, url, payloads[0], headers)
        if not warmup.ok:
            raise ValueError(f"the test request failed: {warmup.error}")
        gaps = random.Random(args.seed)
        tty = sys.stderr.isatty()
        progress = args.progress is not False
        # Plain lines where stderr is not a terminal (a log): a bar's redraws would pile up.
        bar = tqdm(
            total=len(payloads), desc="requests done", unit="req", disable=not progress,
            mininterval=0.1 if tty else 5.0, file=sys.stderr if tty else _Lines(),
        )  # fmt: skip
        start = time.perf_counter()
        tasks = []
        for payload in payloads:
            tasks.append(asyncio.create_task(send_request(client, url, payload, headers)))
            tasks[-1].add_done_callback(lambda _: bar.update(1))
            if args.request_rate != float("inf"):
                await asyncio.sleep(gaps.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return summarize(results, duration) | {"model": model, "request_rate": args.request_rate}


class _Lines:
    """A file for tqdm that prints each of its redraws as a line of its own on stderr."""

    def write(self, text: str) -> None:
        if text.strip("\r\n "):
            print(text.strip("\r\n "), file=sys.stderr, flush=True)

    def flush(self) -> None:
        pass


def _payload(args: argparse.Namespace, model: str, prompt: str | list[int]) -> dict:
    payload = {
        "model": model,
        "prompt": prompt,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        payload["ignore_eos"] = True
    return payload | args.extra_body


async def _first_model(client, base_url: str, headers: dict) -> str:
    response = await client.get(base_url.rstrip("/") + "/v1/models", headers=headers)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def summarize(results: list[RequestResult], duration: float) -> dict:
    """Throughputs, and TTFT / TPOT / ITL in ms as mean, median and p99."""
    import numpy as np

    ok = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [gap for r in ok for gap in r.itl]
    summary: dict = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": output,
        "request_throughput": len(ok) / duration,
        "output_throughput": output / duration,
    }
    for name, values in (("ttft", [r.ttft for r in ok]), ("tpot", tpots), ("itl", itls)):
        ms = np.array(values or [0.0]) * 1000
        summary[f"mean_{name}_ms"] = float(ms.mean())
        summary[f"median_{name}_ms"] = float(np.median(ms))
        summary[f"p99_{name}_ms"] = float(np.percentile(ms, 99))
    return summary


def print_summary(s: dict) -> None:
    print(f"{' Serving Benchmark Result ':=^50}")
    rows = [
        ("Successful requests:", s["completed"]),
        ("Failed requests:", s["failed"]),
        ("Request rate (req/s):", s["request_rate"]),
        ("Benchmark duration (s):", f"{s['duration_s']:.2f}"),
        ("Total input tokens:", s["total_input_tokens"]),
        ("Total generated tokens:", s["total_output_tokens"]),
        ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
    ]
    for label, value in rows:
        print(f"{label:<40}{value:<10}")
    for name, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
    ):
        print(f"{title:-^50}")
        for stat in ("mean", "median", "p99"):
            label = f"{stat.capitalize()} {name.upper()} (ms):"  # Mean, Median, P99
            print(f"{label:<40}{s[f'{stat}_{name}_ms']:<10.2f}")
    for error in s["errors"]:
        print(f"error: {error}")
    print("=" * 50)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if not 0 <= args.random_range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if not isinstance(args.extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")
    summary = asyncio.run(run_benchmark(args))
    print_summary(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["failed"] == 0 else 1


def add_parser(sub) -> None:
    """Registers `octavo bench serve` on the bench subparsers."""
    p = sub.add_parser("serve", help="online serving benchmark against an OpenAI-compatible URL")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's address")
    p.add_argument(
        "--endpoint",
        default="/v1/completions",
        help="the completions route under --base-url (prompts, not chat messages)",
    )
    p.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    p.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"),
        help="sent as a bearer token (default: $OPENAI_API_KEY)",
    )  # fmt: skip
    p.add_argument("--request-rate", type=float, default=float("inf"), help="req/s, or inf")
    p.add_argument("--num-prompts", type=positive_int, default=32, help="requests to send")
    p.add_argument(
        "--input-len",
        type=positive_int,
        default=64,
        help="words (or token ids) per synthetic prompt",
    )
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="prompt lengths uniform over input-len x (1 -/+ this), as in vLLM",
    )
    p.add_argument(
        "--token-ids",
        type=positive_int,
        default=None,
        metavar="N",
        help="send prompts as random token ids below N (for a model without a tokenizer)",
    )
    p.add_argument("--max-tokens", type=positive_int, default=64, help="tokens a request asks for")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument(
        "--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
        help="every request generates all its --max-tokens",
    )  # fmt: skip
    p.add_argument(
        "--extra-body",
        type=json.loads,
        default={},
        help="JSON object merged into every request body (server-specific fields)",
    )
    p.add_argument("--seed", type=int, default=0, help="of the random prompts and arrivals")
    p.add_argument("--json", default=None, help="write the metrics here")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the requests done as they finish: a bar on a terminal, else a line every 5 s "
        "(default: on)",
    )
    p.set_defaults(func=cmd_bench_serve)
