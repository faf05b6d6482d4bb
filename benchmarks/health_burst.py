"""/health under a burst: `octavo serve` on the embedded model, BURST completion requests sent
at once from one process (raw asyncio sockets, a connection each), while a second process
polls /health every 20 ms (a new connection each poll). Reports how long the polls took:
median, p99, max, and how many took over 100 ms; how long each burst took to answer; and the
resident memory of the server's processes (Linux) after the warm-up, a second after each
burst, and with --idle after that long idle.

    python benchmarks/health_burst.py [--burst 500] [--bursts 3] [--runs 3] [--idle 35]
        [--json out.json]

Each run starts a fresh server (its output in --log), answers a warm-up burst of 8, then the
bursts a second apart; `--url` measures a server already running instead.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
import urllib.parse


def poll_health(url: str, stop, out) -> None:
    """Polls /health every 20 ms until `stop` is set; puts the list of latencies (s) on `out`."""
    parts = urllib.parse.urlsplit(url)
    latencies: list[float] = []
    while not stop.is_set():
        start = time.perf_counter()
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        conn.request("GET", "/health")
        status = conn.getresponse().status
        conn.close()
        latencies.append(time.perf_counter() - start)
        if status != 200:
            print(f"/health answered {status}", file=sys.stderr)
        time.sleep(0.02)
    out.put(latencies)


async def _one_request(host: str, port: int, body: bytes) -> int:
    """POSTs `body` to /v1/completions on a connection of its own; the response's status."""
    reader, writer = await asyncio.open_connection(host, port)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    writer.write(head.encode() + body)
    await writer.drain()
    data = await reader.read()
    writer.close()
    return int(data.split(b" ", 2)[1]) if data else 0


async def _burst(url: str, n: int, max_tokens: int) -> tuple[float, dict[int, int]]:
    """Sends `n` completion requests at once; (seconds until all were answered, statuses)."""
    parts = urllib.parse.urlsplit(url)
    request = {"prompt": "The history of the printing press", "max_tokens": max_tokens}
    body = json.dumps(request | {"ignore_eos": True}).encode()
    start = time.perf_counter()
    statuses = await asyncio.gather(
        *(_one_request(parts.hostname, parts.port, body) for _ in range(n))
    )
    counts: dict[int, int] = {}
    for s in statuses:
        counts[s] = counts.get(s, 0) + 1
    return time.perf_counter() - start, counts


def _rss_mib(pid: int | None) -> float | None:
    """Resident memory of a process and its descendants (Linux's /proc), MiB; None elsewhere."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except (OSError, StopIteration):
        return None
    return round(kib / 1024 + sum(_rss_mib(c) or 0.0 for c in children), 1)


def _wait_up(url: str, timeout_s: float) -> None:
    parts = urllib.parse.urlsplit(url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server at {url} did not come up")


def _summary(latencies: list[float]) -> dict[str, float | int]:
    ms = sorted(x * 1000 for x in latencies)
    return {
        "polls": len(ms),
        "median_ms": round(statistics.median(ms), 1),
        "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 1),
        "max_ms": round(ms[-1], 1),
        "over_100ms": sum(x > 100 for x in ms),
        "worst_ms": [round(x, 1) for x in ms[-5:]],
    }


def measure(url: str, args, pid: int | None = None) -> dict:
    """One run against a server that is up (process `pid`, if known): a warm-up burst, then
    `bursts` bursts with the poller running throughout (a second apart)."""
    asyncio.run(_burst(url, 8, args.max_tokens))  # warm-up
    rss = [_rss_mib(pid)]
    stop, out = mp.Event(), mp.Queue()
    poller = mp.Process(target=poll_health, args=(url, stop, out))
    poller.start()
    time.sleep(1.0)
    bursts = []
    for _ in range(args.bursts):
        took, counts = asyncio.run(_burst(url, args.burst, args.max_tokens))
        bursts.append({"seconds": round(took, 2), "statuses": counts})
        time.sleep(1.0)
        rss.append(_rss_mib(pid))
    stop.set()
    latencies = out.get(timeout=120)
    poller.join(30)
    result = {"health": _summary(latencies), "bursts": bursts, "rss_mib": rss}
    if args.idle:  # the server gives free KV blocks back after --kv-idle-release (30 s)
        time.sleep(args.idle)
        result["rss_after_idle_mib"] = _rss_mib(pid)
    return result


def run_once(args) -> dict:
    if args.url:
        return measure(args.url, args)
    url = f"http://127.0.0.1:{args.port}"
    # This checkout's octavo, whichever one the installed package points at.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    command = [sys.executable, "-m", "octavo.entrypoints.cli", "serve", "--port", str(args.port)]
    with open(args.log, "w") as log:
        server = subprocess.Popen(
            command, cwd=root, env={**os.environ, "PYTHONPATH": root}, stdout=log, stderr=log
        )
        try:
            _wait_up(url, 180)
            return measure(url, args, server.pid)
        finally:
            server.terminate()
            server.wait(60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--burst", type=int, default=500, help="requests sent at once")
    p.add_argument("--bursts", type=int, default=3, help="bursts in a run")
    p.add_argument("--runs", type=int, default=3, help="runs, each with a fresh server")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--port", type=int, default=8021)
    p.add_argument("--idle", type=float, default=0.0,
                   help="then wait this many seconds and measure the memory again")  # fmt: skip
    p.add_argument("--url", help="a server already running (no server is started)")
    p.add_argument("--json", help="write the runs here")
    p.add_argument("--log", default="/tmp/octavo_health_burst.log", help="the server's output")
    args = p.parse_args()
    runs = []
    for i in range(args.runs):
        result = run_once(args)
        runs.append(result)
        h = result["health"]
        secs = ", ".join(f"{b['seconds']} s {b['statuses']}" for b in result["bursts"])
        print(f"run {i + 1}: /health median {h['median_ms']} ms, p99 {h['p99_ms']} ms, max "
              f"{h['max_ms']} ms, {h['over_100ms']} of {h['polls']} over 100 ms "
              f"(worst {h['worst_ms']}); bursts {secs}; RSS MiB {result['rss_mib']}"
              + (f", {result['rss_after_idle_mib']} after {args.idle:g} s idle"
                 if args.idle else ""), flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"burst": args.burst, "max_tokens": args.max_tokens, "runs": runs}, f)


if __name__ == "__main__":
    main()
