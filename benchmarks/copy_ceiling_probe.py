"""Where the copy ceiling's spread comes from: device copies (bench_floor.copy_rate, median of
20) of 1 GiB, the bench's size until session 6, against other sizes and fresh buffers, three
allocations each. Run it in several processes to see the spread between them; with
`--engine` it also times an engine start and the eager decode warm-up once its kernels are
loaded.

    PYTHONPATH=. python benchmarks/copy_ceiling_probe.py [--engine]
"""

from __future__ import annotations

import argparse
import time

from octavo.entrypoints.bench_floor import copy_rate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", action="store_true")
    args = parser.parse_args()
    rows = [
        f"{size_mib}M:{copy_rate(size_mib << 20, 'cuda') / 1e12:.3f}"
        for size_mib in (1024, 4096, 1024, 256, 1024)
        for _ in range(3)
    ]
    print("copy TB/s (read + written), size:rate", " ".join(rows))
    if args.engine:
        from octavo import LLM

        start = time.perf_counter()
        llm = LLM("qwen3-0.6b", load_format="dummy", max_model_len=4096)
        init_s = time.perf_counter() - start
        start = time.perf_counter()
        llm.engine.runner._warm_up_eager_decode(256)
        print(f"LLM init {init_s:.2f} s; the warm-up again (kernels loaded): "
              f"{time.perf_counter() - start:.3f} s")


if __name__ == "__main__":
    main()
