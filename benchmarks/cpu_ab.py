"""CPU A/B of source trees on a shared 2-core machine, two ways:

- `throughput OLD NEW`: `octavo bench throughput --peer hf` on each tree in turn (A, B, A,
  B, ...), each run started once the machine has been quiet for a while and recording how
  busy the *other* processes kept the cores meanwhile: with 2 cores and 2 OpenMP threads one
  busy foreign process slows every parallel op several-fold, so such a run is reported as
  such rather than silently averaged in.
- `startup [TREE ...]`: `LLM()` on the embedded model, each run in a fresh process, phase by
  phase (`--serve`: `octavo serve` until its /health answers; `--peer hf`: transformers'
  tokenizer and float32 model from the same GGUF file, in the same rounds). Warm runs keep the converted GGUF tokenizer in a cache directory shared by a tree's
  runs; cold runs start with an empty one (the page cache stays warm either way). Trees
  alternate, so that a busy machine slows all alike.

    git worktree add --detach /tmp/old main      # the tree to compare against
    python benchmarks/cpu_ab.py throughput /tmp/old . --pairs 3 --out /tmp/ab
    python benchmarks/cpu_ab.py startup /tmp/old . --runs 7 --cold 3 --json out.json
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
import time

HZ = os.sysconf("SC_CLK_TCK")


def busy_jiffies() -> int:
    """All cores' non-idle time since boot (user + nice + system + irq + softirq + steal)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return v[0] + v[1] + v[2] + v[5] + v[6] + v[7]


def proc_jiffies(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            v = f.read().rsplit(")", 1)[1].split()
        return int(v[11]) + int(v[12]) + int(v[13]) + int(v[14])  # utime stime cutime cstime
    except FileNotFoundError:
        return 0


def wait_quiet(max_other_cores: float, window_s: float, give_up_s: float) -> float:
    """Waits until the cores were busy below `max_other_cores` over one window; returns the
    last window's busy cores (the caller records it)."""
    deadline = time.time() + give_up_s
    while True:
        b0 = busy_jiffies()
        time.sleep(window_s)
        cores = (busy_jiffies() - b0) / HZ / window_s
        if cores <= max_other_cores or time.time() > deadline:
            return cores


def run_throughput(tree: str, json_path: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    cmd = ["octavo", "bench", "throughput", "--peer", "hf", "--json", json_path]
    b0, t0 = busy_jiffies(), time.time()
    child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    last = 0
    while child.poll() is None:  # the child's own time, sampled until it exits
        last = max(last, proc_jiffies(child.pid))
        time.sleep(0.5)
    elapsed = time.time() - t0
    stdout = child.stdout.read().decode() if child.stdout else ""
    if child.returncode:
        raise RuntimeError(f"{cmd} failed:\n{stdout}")
    other = max(busy_jiffies() - b0 - last, 0) / HZ / elapsed
    with open(json_path) as f:
        octavo, hf = json.load(f)["results"]
    return {
        "octavo_tok_s": octavo["tok_per_s"],
        "hf_tok_s": hf["tok_per_s"],
        "ratio": octavo["tok_per_s"] / hf["tok_per_s"],
        "other_cores_busy": round(other, 2),
    }


PHASES = ("import torch", "import octavo", "config", "tokenizer",
          "weights", "kv cache", "LLM()", "total", "transformers imported")  # fmt: skip


def startup_child() -> None:
    """One start-up, timed phase by phase; prints the phases' seconds as JSON."""
    import time

    start = time.perf_counter()
    import torch  # noqa: F401

    after_torch = time.perf_counter()
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
        "import octavo": after_octavo - after_torch,
        "transformers imported": float("transformers" in sys.modules),
        "LLM()": end - after_octavo,
        "total": end - start,
    }
    print(json.dumps(seconds))


def hf_startup_child() -> None:
    """The HF peer's start-up: transformers' tokenizer and float32 model from the embedded
    model's GGUF file, as `octavo bench throughput --peer hf` loads them; prints the seconds
    as JSON."""
    start = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from octavo.checkpoint.embedded import embedded_model_path

    directory, name = os.path.split(embedded_model_path())
    AutoTokenizer.from_pretrained(directory, gguf_file=name)
    AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    print(json.dumps({"total": time.perf_counter() - start}))


def run_startup(tree: str, cache_dir: str, child: str = "startup-child") -> dict[str, float]:
    env = os.environ | {"PYTHONPATH": os.path.abspath(tree), "OCTAVO_CACHE_DIR": cache_dir}
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), child],
        env=env,
        cwd=tempfile.gettempdir(),  # import octavo from `tree`, never from the current directory
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def throughput(args: argparse.Namespace) -> None:
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for i in range(1, args.pairs + 1):
        for side, tree in (("old", args.old), ("new", args.new)):
            rev = subprocess.check_output(["git", "-C", tree, "rev-parse", "--short", "HEAD"])
            before = wait_quiet(args.quiet_cores, args.quiet_window, args.give_up)
            r = run_throughput(tree, f"{args.out}/pair{i}-{side}.json")
            r |= {"pair": i, "code": f"{side} {rev.decode().strip()}", "busy_before": before}
            rows.append(r)
            print(json.dumps(r), flush=True)
    with open(f"{args.out}/summary.json", "w") as f:
        json.dump(rows, f, indent=2)
    print(
        f"{'pair':<5}{'code':<13}{'octavo tok/s':>13}{'HF tok/s':>10}{'ratio':>8}{'other load':>11}"
    )
    for r in rows:
        print(
            f"{r['pair']:<5}{r['code']:<13}{r['octavo_tok_s']:>13.1f}{r['hf_tok_s']:>10.1f}"
            f"{r['ratio']:>7.2f}x{r['other_cores_busy']:>10.2f}"
        )


def run_serve(tree: str, cache_dir: str) -> dict[str, float]:
    """Seconds from starting `octavo serve` until its /health answers 200."""
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = os.environ | {"PYTHONPATH": os.path.abspath(tree), "OCTAVO_CACHE_DIR": cache_dir}
    argv = [sys.executable, "-m", "octavo.entrypoints.cli", "serve", "--port", str(port)]
    start = time.perf_counter()
    server = subprocess.Popen(
        [*argv, "--log-level", "warning"], env=env, cwd=tempfile.gettempdir(),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        while server.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return {"octavo serve": time.perf_counter() - start}
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"octavo serve exited with status {server.returncode}")
    finally:
        server.terminate()
        server.wait(30)


def startup(args: argparse.Namespace) -> None:
    run, phases = (run_serve, ("octavo serve",)) if args.serve else (run_startup, PHASES)
    runs: dict[str, dict[str, list[dict[str, float]]]] = {
        t: {"warm": [], "cold": []} for t in [*args.trees, *(["hf"] if args.peer else [])]
    }
    warm_dirs = {t: tempfile.mkdtemp(prefix="octavo-startup-") for t in args.trees}
    for tree in args.trees:  # fills each tree's warm cache
        run(tree, warm_dirs[tree])
    cold = args.runs if args.cold is None else args.cold
    for i in range(max(args.runs, cold)):
        for tree in args.trees:
            if i < args.runs:
                runs[tree]["warm"].append(run(tree, warm_dirs[tree]))
            if i < cold:
                with tempfile.TemporaryDirectory(prefix="octavo-startup-") as empty:
                    runs[tree]["cold"].append(run(tree, empty))
    # The peer's runs come last: each takes ~20 s of both cores, after which the next start,
    # interleaved, measured ~0.3 s slower.
    for _ in range(args.runs if args.peer else 0):
        runs["hf"]["warm"].append(run_startup(args.trees[0], "", "startup-hf-child"))
    print(f"{'tree':<20} {'cache':<5} " + " ".join(f"{p:>19}" for p in phases))
    for tree, by_state in runs.items():
        for state, rows in by_state.items():
            if rows:
                medians = [statistics.median(r.get(p, 0.0) for r in rows) for p in phases]
                print(f"{tree:<20} {state:<5} " + " ".join(f"{m:>19.2f}" for m in medians))
    print("medians of", args.runs, "warm and", cold, "cold runs, seconds")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    for directory in warm_dirs.values():
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    if sys.argv[1:] == ["startup-child"]:  # one timed start-up, in the process run_startup made
        return startup_child()
    if sys.argv[1:] == ["startup-hf-child"]:
        return hf_startup_child()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("throughput", help="octavo bench throughput --peer hf, alternated")
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--out", default="/tmp/cpu_ab")
    p.add_argument("--quiet-cores", type=float, default=0.15, help="busy cores that count as quiet")
    p.add_argument("--quiet-window", type=float, default=10.0)
    p.add_argument("--give-up", type=float, default=600.0, help="max seconds to wait for quiet")
    p = sub.add_parser("startup", help="LLM() phase by phase in fresh processes")
    p.add_argument("trees", nargs="*", default=["."], help="source trees to time")
    p.add_argument("--runs", type=int, default=5, help="runs per tree and cache state")
    p.add_argument("--cold", type=int, default=None, help="cold runs (default: --runs)")
    p.add_argument("--json", help="write every run's phases here")
    p.add_argument("--serve", action="store_true", help="time `octavo serve` until /health")
    p.add_argument("--peer", choices=["hf"], help="also time transformers' start-up (total)")
    args = parser.parse_args()
    (throughput if args.mode == "throughput" else startup)(args)


if __name__ == "__main__":
    main()
