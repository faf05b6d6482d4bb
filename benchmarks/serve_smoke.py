"""`octavo serve` end to end on a dummy model: start the server, send concurrent completions of
token-id prompts, check every one comes back with its tokens, and stop the server.

A check more than a benchmark: on the GPU it covers the engine process that `octavo serve`
spawns, which builds the model, captures the CUDA graphs and steps the engine. It prints how
long the server took to answer /health (its start-up) and the slowest completion.

    python benchmarks/serve_smoke.py [--model qwen3-0.6b] [--port 8041] [--requests 16]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import time

import httpx


async def complete(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], n: int):
    start = time.perf_counter()
    r = await client.post(
        url,
        json={"model": model, "prompt": prompt, "max_tokens": n, "ignore_eos": True},
        timeout=120,
    )
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"], time.perf_counter() - start


async def run(base: str, model: str, requests: int, max_tokens: int) -> int:
    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(16, 512))] for _ in range(requests)]
    async with httpx.AsyncClient() as client:
        results = await asyncio.gather(
            *(complete(client, f"{base}/v1/completions", model, p, max_tokens) for p in prompts)
        )
    ok = sum(tokens == max_tokens for tokens, _ in results)
    slowest = max(seconds for _, seconds in results)
    print(f"{ok} of {requests} completions gave {max_tokens} tokens; slowest {slowest:.2f} s")
    return 0 if ok == requests else 1


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--port", type=int, default=8041)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    command = [
        sys.executable,
        "-m",
        "octavo.entrypoints.cli",
        "serve",
        "--model",
        args.model,
        "--load-format",
        "dummy",
        "--port",
        str(args.port),
    ]
    server = subprocess.Popen(command)
    try:
        start = time.perf_counter()
        while True:
            if server.poll() is not None:
                print(f"the server exited with {server.returncode}")
                return 1
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        print(f"server up in {time.perf_counter() - start:.1f} s")
        return asyncio.run(run(base, args.model, args.requests, args.max_tokens))
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
