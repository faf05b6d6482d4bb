"""`LLM()` start-up on the embedded model, each run in a fresh process, and where it goes.

Warm runs keep the converted GGUF tokenizer in a cache directory shared by all runs of a tree;
cold runs start with an empty one (the operating system's page cache stays warm either way).
With several trees the runs alternate between them, so that a busy machine slows all alike.

    python benchmarks/startup.py --runs 5                          # this tree
    python benchmarks/startup.py /tmp/old . --runs 5 --json out.json   # two trees, alternated
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

PHASES = ("import torch", "import transformers", "import octavo", "config", "tokenizer",
          "weights", "kv cache", "LLM()", "total")  # fmt: skip


def child() -> None:
    """One start-up, timed phase by phase; prints the phases' seconds as JSON."""
    import time

    start = time.perf_counter()
    import torch  # noqa: F401

    after_torch = time.perf_counter()
    from transformers import AutoTokenizer, PretrainedConfig  # noqa: F401

    after_transformers = time.perf_counter()
    from octavo.engine import builder
    from octavo.entrypoints.llm import LLM
    from octavo.runner import model_runner

    after_octavo = time.perf_counter()
    seconds: dict[str, float] = {}

    def timed(owner, name: str, phase: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - t

        setattr(owner, name, wrapper)

    timed(builder, "load_hf_config", "config")
    timed(builder, "load_tokenizer", "tokenizer")
    timed(model_runner, "load_model", "weights")
    timed(model_runner.ModelRunner, "allocate_kv_cache", "kv cache")
    LLM()
    end = time.perf_counter()
    seconds |= {
        "import torch": after_torch - start,
        "import transformers": after_transformers - after_torch,
        "import octavo": after_octavo - after_transformers,
        "LLM()": end - after_octavo,
        "total": end - start,
    }
    print(json.dumps(seconds))


def run_once(tree: str, cache_dir: str) -> dict[str, float]:
    env = os.environ | {"PYTHONPATH": os.path.abspath(tree), "OCTAVO_CACHE_DIR": cache_dir}
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child"],
        env=env,
        cwd=tempfile.gettempdir(),  # import octavo from `tree`, never from the current directory
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="*", default=["."], help="source trees to time")
    parser.add_argument("--runs", type=int, default=5, help="runs per tree and cache state")
    parser.add_argument("--cold", type=int, default=None, help="cold runs (default: --runs)")
    parser.add_argument("--json", help="write every run's phases here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child()
    runs: dict[str, dict[str, list[dict[str, float]]]] = {
        t: {"warm": [], "cold": []} for t in args.trees
    }
    warm_dirs = {t: tempfile.mkdtemp(prefix="octavo-startup-") for t in args.trees}
    for tree in args.trees:  # fills each tree's warm cache
        run_once(tree, warm_dirs[tree])
    cold = args.runs if args.cold is None else args.cold
    for i in range(max(args.runs, cold)):
        for tree in args.trees:
            if i < args.runs:
                runs[tree]["warm"].append(run_once(tree, warm_dirs[tree]))
            if i < cold:
                with tempfile.TemporaryDirectory(prefix="octavo-startup-") as empty:
                    runs[tree]["cold"].append(run_once(tree, empty))
    print(f"{'tree':<20} {'cache':<5} " + " ".join(f"{p:>19}" for p in PHASES))
    for tree, by_state in runs.items():
        for state, rows in by_state.items():
            if rows:
                medians = [statistics.median(r.get(p, 0.0) for r in rows) for p in PHASES]
                print(f"{tree:<20} {state:<5} " + " ".join(f"{m:>19.2f}" for m in medians))
    print("medians of", args.runs, "warm and", cold, "cold runs, seconds")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    for directory in warm_dirs.values():
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
