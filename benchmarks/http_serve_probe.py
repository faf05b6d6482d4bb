"""Online serving over HTTP against the same engine driven in process: what the server adds.

    PYTHONPATH=. python benchmarks/http_serve_probe.py --model qwen3-0.6b [--json out.json]

For each server setting, `octavo serve` (dummy weights, 2,048 tokens a step) runs in a process
of its own and `octavo bench serve` runs against it at each --rate: Poisson arrivals, prompts
of 64-512 random token ids (--input-len, --range-ratio), --output-len tokens each (ignore_eos),
streamed. Both processes' CPU seconds are read from /proc around each run, per thread for the
server, to see which thread is busy. Settings:
- `default`: `octavo serve` as shipped: the engine in a process of its own (since session 13);
- `thread`: `octavo serve --engine-in-thread`, the engine on a thread of the server's process;
- `switch=S`: `thread` after `sys.setswitchinterval(S)` (how long a thread may hold the GIL
  while another waits for it; Python's default is 5 ms);
- `scan`: `thread` with the engine's stats as before session 13, when the count of shared KV
  blocks walked every block of the pool after each step;
- `tree=DIR`: `default` with the octavo package found in DIR (an older commit unpacked
  there, to compare two versions of the server in one run).

Then the same requests go through `Engine.add_request` / `step` in this process
(`mixed_graph_probe.serve`): the in-process figures are what the engine gives with no server.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import httpx

RANGE = 0.7778  # --input-len 288 with this ratio draws lengths of 64-512, as the probe does


def prompt_lens(args: argparse.Namespace) -> tuple[int, int]:
    """The prompt lengths `octavo bench serve` draws from (vLLM's --random-range-ratio)."""
    return round(args.input_len * (1 - args.range_ratio)), round(
        args.input_len * (1 + args.range_ratio)
    )


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of `pid`, by thread id ("main" for the
    main thread: the event loop; Python does not name the others for the OS)."""
    tick = os.sysconf("SC_CLK_TCK")
    result: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        result["main" if tid == str(pid) else tid] = (int(fields[11]) + int(fields[12])) / tick
    return result


def children_cpu(pid: int) -> float:
    """CPU seconds of `pid`'s child processes (the engine process), all threads."""
    total = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                children = f.read().split()
        except FileNotFoundError:
            continue
        for child in children:
            try:
                total += sum(thread_cpu(int(child)).values())
            except FileNotFoundError:
                continue
    return total


def wait_up(base: str, server: subprocess.Popen, timeout: float = 300, poll: float = 0.5) -> float:
    """Seconds until the server at `base` answers /health (polled every `poll` s)."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(poll)
    raise RuntimeError("the server did not come up")


def bench(base: str, rate: float, args: argparse.Namespace, out: str) -> dict:
    command = [
        sys.executable, "-m", "octavo.entrypoints.cli", "bench", "serve", "--base-url", base,
        "--request-rate", str(rate), "--num-prompts", str(args.num_requests),
        "--input-len", str(args.input_len), "--random-range-ratio", str(args.range_ratio),
        "--token-ids", "10000",
        "--max-tokens", str(args.output_len), "--seed", "2", "--json", out,
    ]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(out) as f:
        summary = json.load(f)
    summary["client_cpu_s"] = (after.ru_utime + after.ru_stime) - (
        before.ru_utime + before.ru_stime
    )
    return summary


def server_ttft(base: str) -> tuple[float, float]:
    """The server's own TTFT histogram (from the request reaching the engine front to its
    first token): (sum of seconds, count)."""
    lines = httpx.get(f"{base}/metrics", timeout=5).text.splitlines()
    name = "octavo_time_to_first_token_seconds"
    value = {line.split()[0]: float(line.split()[-1]) for line in lines if line.startswith(name)}
    return value[f"{name}_sum"], value[f"{name}_count"]


def run_server(setting: str, args: argparse.Namespace, port: int) -> dict:
    base = f"http://127.0.0.1:{port}"
    prelude = ""
    if setting.startswith("switch="):
        prelude = f"sys.setswitchinterval({setting.split('=')[1]}); "
    elif setting == "scan":
        prelude = (
            "from octavo.core.kv_cache_manager import KVCacheManager as K; "
            "K.num_shared_block_refs = property("
            "lambda self: sum(b.ref_cnt - 1 for b in self.pool.blocks if b.ref_cnt > 1)); "
        )
    code = f"import sys; {prelude}from octavo.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    command = [
        sys.executable, "-c", code, "serve", "--model", args.model, "--load-format", "dummy",
        "--max-model-len", "4096", "--max-num-batched-tokens", "2048", "--port", str(port),
        "--log-level", "warning",
    ]  # fmt: skip
    env, cwd = None, None
    if setting.startswith("tree="):  # `-c` code imports from its working directory first
        cwd = setting.split("=", 1)[1]
        env = {**os.environ, "PYTHONPATH": cwd + os.pathsep + os.environ.get("PYTHONPATH", "")}
    elif setting != "default":
        command.append("--engine-in-thread")
    server = subprocess.Popen(command, env=env, cwd=cwd)
    report: dict = {"setting": setting, "runs": []}
    try:
        report["startup_s"] = wait_up(base, server)
        for rate in args.rates:
            cpu_before, engine_before = thread_cpu(server.pid), children_cpu(server.pid)
            ttft_before = server_ttft(base)
            summary = bench(base, rate, args, f"/tmp/http_probe_{port}_{rate}.json")
            cpu_after, engine_after = thread_cpu(server.pid), children_cpu(server.pid)
            ttft_after = server_ttft(base)
            count = ttft_after[1] - ttft_before[1]
            summary["server_ttft_ms"] = 1e3 * (ttft_after[0] - ttft_before[0]) / max(count, 1)
            used = {k: v - cpu_before.get(k, 0.0) for k, v in cpu_after.items()}
            others = sorted((v for k, v in used.items() if k != "main"), reverse=True) or [0.0]
            summary["server_cpu_s"] = {
                "main": round(used["main"], 2),
                "busiest": round(others[0], 2),  # the engine thread, or any other
                "rest": round(sum(others[1:]), 2),
                "children": round(engine_after - engine_before, 2),  # the engine process
                "seconds": summary["duration_s"],
            }
            report["runs"].append(summary)
        metrics = httpx.get(f"{base}/metrics", timeout=5).text.splitlines()
        report["kv_blocks_total"] = next(
            float(line.split()[-1]) for line in metrics if line.startswith("octavo_kv_blocks_total")
        )
    finally:
        server.terminate()
        server.wait(timeout=60)
    return report


def in_process(args: argparse.Namespace) -> list[dict]:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from mixed_graph_probe import serve

    from octavo import LLM

    llm = LLM(args.model, load_format="dummy", max_model_len=4096, max_num_batched_tokens=2048)
    lens = prompt_lens(args)
    return [serve(llm.engine, r, args.num_requests, args.output_len, 2, lens) for r in args.rates]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--rates", type=float, nargs="+", default=[16.0, 64.0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=288)
    parser.add_argument("--range-ratio", type=float, default=RANGE)
    parser.add_argument("--settings", nargs="+", default=["default", "thread", "scan"])
    parser.add_argument("--no-in-process", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    report: dict = {"model": args.model, "servers": []}
    for i, setting in enumerate(args.settings):
        report["servers"].append(run_server(setting, args, 8060 + i))
    if not args.no_in_process:
        report["in_process"] = in_process(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)

    blocks = report["servers"][0].get("kv_blocks_total")
    low, high = prompt_lens(args)
    print(f"{args.model}, {args.num_requests} requests, prompts of {low}-{high} tokens, "
          f"{args.output_len} tokens each, {blocks:.0f} KV blocks; ms")  # fmt: skip
    print(f"{'setting':<16}{'rate':>6}{'tok/s':>8}{'TTFT':>8}{'p99':>8}{'TPOT':>7}{'p99':>7}"
          f"{'ITL p99':>9}{'server TTFT':>12}  cpu s: client / server threads")  # fmt: skip
    for server in report["servers"]:
        for s in server["runs"]:
            cpu = " ".join(f"{k}={v:.1f}" for k, v in s["server_cpu_s"].items())
            print(f"{server['setting']:<16}{s['request_rate']:>6.0f}{s['output_throughput']:>8.0f}"
                  f"{s['mean_ttft_ms']:>8.1f}{s['p99_ttft_ms']:>8.1f}{s['mean_tpot_ms']:>7.2f}"
                  f"{s['p99_tpot_ms']:>7.2f}{s['p99_itl_ms']:>9.1f}{s['server_ttft_ms']:>12.1f}"
                  f"  {s['client_cpu_s']:.1f} / {cpu}")  # fmt: skip
    for s in report.get("in_process", []):
        print(f"{'in process':<16}{s['rate']:>6.0f}{s['output_tok_s']:>8.0f}{s['ttft_mean_ms']:>8.1f}"
              f"{s['ttft_p99_ms']:>8.1f}{s['tpot_mean_ms']:>7.2f}{s['tpot_p99_ms']:>7.2f}"
              f"{s['itl_p99_ms']:>9.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
