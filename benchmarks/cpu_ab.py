"""A/B of `octavo bench throughput --peer hf` between two source trees on a shared CPU machine.

Runs alternate (A, B, A, B, ...), each started only once the machine has been quiet for a
while, and each records how busy the *other* processes kept the cores while it ran: with 2
cores and 2 OpenMP threads, one busy foreign process slows every parallel op several-fold, so
a run with foreign load is reported as such rather than silently averaged in.

    git worktree add --detach /tmp/old main      # the tree to compare against
    python benchmarks/cpu_ab.py /tmp/old . --pairs 3 --out /tmp/ab
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
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


def run(tree: str, json_path: str) -> dict:
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--out", default="/tmp/cpu_ab")
    p.add_argument("--quiet-cores", type=float, default=0.15, help="busy cores that count as quiet")
    p.add_argument("--quiet-window", type=float, default=10.0)
    p.add_argument("--give-up", type=float, default=600.0, help="max seconds to wait for quiet")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for i in range(1, args.pairs + 1):
        for side, tree in (("old", args.old), ("new", args.new)):
            rev = subprocess.check_output(["git", "-C", tree, "rev-parse", "--short", "HEAD"])
            before = wait_quiet(args.quiet_cores, args.quiet_window, args.give_up)
            r = run(tree, f"{args.out}/pair{i}-{side}.json")
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


if __name__ == "__main__":
    main()
