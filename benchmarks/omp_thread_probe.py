"""On the CPU: what it costs to step an Engine on a thread other than the one that built it.

torch's OpenMP pool belongs to the thread that runs the parallel ops. Once the main thread
has one (it built the model), a second thread's ops get a second pool on the same cores, and
libgomp stops the idle workers from spinning: each parallel op then waits for one to wake.
This times one small projection and the embedded model's decode step three ways, each in a
fresh process: on the main thread; on another thread after the main thread ran ops; and on
a thread that also built the engine (what AsyncEngine.build does).

    PYTHONPATH=. python benchmarks/omp_thread_probe.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

WAYS = ("main thread", "other thread, main built", "thread that built")


def _linear_us() -> float:
    import torch

    x, w = torch.randn(2, 576), torch.randn(1536, 576)  # the embedded model's gate/up, batch 2
    for _ in range(200):
        torch.nn.functional.linear(x, w)
    start = time.perf_counter()
    for _ in range(2000):
        torch.nn.functional.linear(x, w)
    return (time.perf_counter() - start) / 2000 * 1e6


def _decode_ms(engine) -> float:
    from octavo.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)
    for name in ("warm-up", "timed"):
        engine.add_request("word " * 64, params, name)
        engine.step()  # the prefill
        start, steps = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
    return (time.perf_counter() - start) / steps * 1e3


def _time(engine) -> dict:
    return {"linear_us": _linear_us(), "decode_ms": _decode_ms(engine)}


def _on_new_thread(fn) -> dict:
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(fn()))
    thread.start()
    thread.join()
    return result


def _measure(way: str) -> dict:
    from octavo.engine.builder import build_engine

    if way == WAYS[2]:
        return _on_new_thread(lambda: _time(build_engine()))
    engine = build_engine()
    if way == WAYS[0]:
        return _time(engine)
    return _on_new_thread(lambda: _time(engine))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--way", help=argparse.SUPPRESS)  # one measurement, in a child
    args = parser.parse_args()
    if args.way:
        print(json.dumps(_measure(args.way)))
        return
    rows = {}
    for way in WAYS:
        out = subprocess.run(
            [sys.executable, __file__, "--way", way], capture_output=True, text=True, check=True
        ).stdout
        rows[way] = json.loads(out.strip().splitlines()[-1])
    print(f"{'where the ops run':28} {'linear 2x576x1536 (us)':>24} {'decode step (ms)':>18}")
    for way, r in rows.items():
        print(f"{way:28} {r['linear_us']:24.1f} {r['decode_ms']:18.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
