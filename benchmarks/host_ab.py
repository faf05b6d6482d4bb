"""A/B of the host's decode step between two source trees, in one process, on the CPU.

Wall times on a shared 2-core machine drift by 20-50% from run to run, more than a change
to the host's Python work moves them. So both engines run in one process, in turn: the
tree under test as `octavo`, the other as a renamed copy (`octavo_base`), each generating
the same batch in rounds A, B, A, B, ...; a round's ratio compares runs seconds apart.

    git worktree add --detach /tmp/base REV
    PYTHONPATH=. python benchmarks/host_ab.py /tmp/base [--rounds 8] [--async-scheduling]
        [--temperature 0] [--stream] [--json out.json]

The model is host_overhead.py's: a 1-layer, 64-wide Qwen3 whose forward pass returns zeros,
so a step is host work (and the CPU sampler's own work, which a GPU does on the device:
`--temperature 0` leaves out its random draws). `--stream` adds requests one by one with
DELTA outputs, as a server does, instead of `LLM.generate`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from host_overhead import host_only_llm, time_steps

BASE_NAME = "octavo_base"


def renamed_copy(tree: Path, into: Path) -> None:
    """Copies tree/octavo to into/octavo_base with its own imports renamed."""
    target = into / BASE_NAME
    shutil.copytree(tree / "octavo", target, ignore=shutil.ignore_patterns("__pycache__"))
    pattern = re.compile(r"\b(from|import) octavo\b|([\"'])octavo\.")
    for path in target.rglob("*.py"):
        text = path.read_text()
        path.write_text(
            pattern.sub(lambda m: f"{m[1]} {BASE_NAME}" if m[1] else f"{m[2]}{BASE_NAME}.", text)
        )


def make_engine(package: str, async_scheduling: bool):
    """(the package module, an LLM on the host-only model, its list of step seconds)."""
    module = importlib.import_module(package)
    llm = host_only_llm(module.LLM, async_scheduling=async_scheduling)
    return module, llm, time_steps(llm.engine)


def generate(module, llm, prompts: list[list[int]], args, tag: str) -> None:
    params = [
        module.SamplingParams(
            temperature=args.temperature, ignore_eos=True, max_tokens=args.max_tokens
        )
        for _ in prompts
    ]
    if not args.stream:
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return
    engine = llm.engine
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        p.output_kind = module.sampling_params.RequestOutputKind.DELTA
        engine.add_request(ids, p, f"{tag}-{i}")
    while engine.has_unfinished_requests():
        engine.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the other source tree (its octavo/ package)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    torch.set_num_threads(1)  # the CPU sampler's ops must not wait for the other core
    copy_dir = Path(tempfile.mkdtemp())
    renamed_copy(Path(args.base), copy_dir)
    sys.path.insert(0, str(copy_dir))
    engines = {name: make_engine(name, args.async_scheduling) for name in (BASE_NAME, "octavo")}
    rng = random.Random(0)
    prompts = [[rng.randint(2, 1000) for _ in range(args.prompt_len)] for _ in range(args.num_seqs)]
    medians: dict[str, list[float]] = {name: [] for name in engines}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name, (module, llm, times) in engines.items():
            times.clear()
            generate(module, llm, prompts, args, f"ab{round_}")
            if round_:
                medians[name].append(1e3 * statistics.median(times))
    ratios = [new / old for old, new in zip(medians[BASE_NAME], medians["octavo"], strict=True)]
    print(f"{args.num_seqs} rows, {args.max_tokens} tokens, temperature {args.temperature}, "
          f"async {args.async_scheduling}, stream {args.stream}")  # fmt: skip
    for name, values in medians.items():
        print(f"{name:12s} median step ms by round: " + " ".join(f"{v:.2f}" for v in values))
    print(f"this tree / {args.base}: " + " ".join(f"{r:.3f}" for r in ratios)
          + f"; median {statistics.median(ratios):.3f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "medians_ms": medians,
                                               "ratios": ratios}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
