"""What one step's message costs to cross `octavo serve`'s engine pipe: pickling and unpickling
("step", outputs, stats) with one DELTA RequestOutput per stream, as engine_process.py sends.

    PYTHONPATH=. python benchmarks/pipe_pickle.py [--streams 16 64 256] [--logprobs 5]

Each output holds one new token and its text (and, with --logprobs K, that token's K
alternatives). Best of 50 rounds each. Run it with another tree on PYTHONPATH to compare.
"""

from __future__ import annotations

import argparse
import pickle
import time
from pathlib import Path

import octavo
from octavo.outputs import CompletionOutput, Logprob, RequestOutput


def step_message(streams: int, logprobs: int) -> tuple:
    outputs = []
    for i in range(streams):
        top = None
        if logprobs:
            top = [{1000 + k: Logprob(-0.5 * k, k + 1, f" w{k}") for k in range(logprobs)}]
        completion = CompletionOutput(0, " word", [1000], logprobs=top)
        outputs.append(RequestOutput(f"cmpl-{i:032x}-0", None, None, [completion], False, 16))
    stats = {f"counter_{k}": k for k in range(24)}
    return ("step", outputs, stats)


def best_ms(fn, rounds: int = 50) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--logprobs", type=int, default=0)
    args = parser.parse_args()
    print(f"octavo from {Path(octavo.__file__).parent}, logprobs {args.logprobs}")
    print("streams   bytes  pickle ms  unpickle ms")
    for streams in args.streams:
        message = step_message(streams, args.logprobs)
        data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        dump = best_ms(lambda m=message: pickle.dumps(m, pickle.HIGHEST_PROTOCOL))
        load = best_ms(lambda d=data: pickle.loads(d))
        print(f"{streams:7d}  {len(data):6d}  {dump:9.3f}  {load:11.3f}")


if __name__ == "__main__":
    main()
