"""How long the embedded model takes to start: `LLM()`, and `octavo serve` until /health answers.

    python benchmarks/startup_probe.py [--tree DIR] [--repeats 2] [--json out.json]

Each measurement runs in a fresh process. With an empty OCTAVO_CACHE_DIR of its own first
("cold": the GGUF tokenizer is converted), then again with what that run cached ("warm").
`--tree DIR` runs the octavo package found in DIR instead (an older commit unpacked there).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from http_serve_probe import wait_up

LLM_CODE = "import time; t = time.perf_counter(); from octavo import LLM; LLM(); print(time.perf_counter() - t)"


def env_for(tree: str | None, cache: str) -> dict:
    env = {**os.environ, "OCTAVO_CACHE_DIR": cache}
    if tree:
        env["PYTHONPATH"] = tree + os.pathsep + env.get("PYTHONPATH", "")
    return env


def time_llm(tree: str | None, cache: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", LLM_CODE], env=env_for(tree, cache), cwd=tree, check=True,
        capture_output=True, text=True,
    )  # fmt: skip
    return float(out.stdout.split()[-1])


def time_serve(tree: str | None, cache: str, extra: list[str], port: int = 8095) -> float:
    code = "import sys; from octavo.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    command = [sys.executable, "-c", code, "serve", "--port", str(port), "--log-level", "warning"]
    server = subprocess.Popen(
        command + extra, env=env_for(tree, cache), cwd=tree, stdout=subprocess.DEVNULL
    )
    try:
        return wait_up(f"http://127.0.0.1:{port}", server, poll=0.05)
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", default=None)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for _ in range(args.repeats):
        for name, run in (
            ("LLM()", lambda cache: time_llm(args.tree, cache)),
            ("serve", lambda cache: time_serve(args.tree, cache, [])),
            ("serve --engine-in-thread", lambda cache: time_serve(args.tree, cache, ["--engine-in-thread"])),
        ):  # fmt: skip
            with tempfile.TemporaryDirectory() as cache:
                cold, warm = run(cache), run(cache)
            rows.append({"what": name, "cold_s": cold, "warm_s": warm})
            print(json.dumps(rows[-1]), flush=True)
    label = args.tree or "this tree"
    print(f"\n{label}: seconds to start, cold (tokenizer converted) / warm (cached)")
    for r in rows:
        print(f"{r['what']:<26}{r['cold_s']:>7.1f}{r['warm_s']:>7.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tree": args.tree, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
