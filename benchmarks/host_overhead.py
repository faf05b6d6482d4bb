"""Host time per engine step at a large decode batch, with a model too small to matter.

The GPU throughput of a small model is bound by how fast the host prepares each step
(scheduling, input tensors, sampling metadata, appending tokens). This runs the whole engine
on the CPU with a 1-layer, 64-wide Qwen3 and a 1k vocabulary whose forward pass is replaced
by zeros, so a step's time is host work, and reports milliseconds per step at batch
`--num-seqs`: the mean over the run (prefill steps included) and the median step, which is
a decode step of the whole batch. At `--temperature 0` the CPU sampler draws no random
numbers, work that a GPU does on the device rather than on the host.

    PYTHONPATH=. python benchmarks/host_overhead.py [--num-seqs 256] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import statistics
import tempfile
import time
from pathlib import Path

TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "tie_word_embeddings": True,
    "eos_token_id": 1,
}


def host_only_llm(llm_class, **options):
    """An LLM (of `llm_class`, octavo's or another tree's) on TINY_QWEN3 whose forward pass
    returns zeros, so that a step's time is the host's work."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(TINY_QWEN3))
        llm = llm_class(tmp, load_format="dummy", device="cpu", kv_cache_memory=1 << 30, **options)
    hidden = TINY_QWEN3["hidden_size"]
    llm.engine.runner._forward = lambda ids, pos, md: torch.zeros(ids.shape[0], hidden)
    return llm


def time_steps(engine) -> list[float]:
    """Times every later `engine.step()`: returns the list each call appends its seconds to."""
    times: list[float] = []
    real_step = engine.step

    def timed():
        start = time.perf_counter()
        outputs = real_step()
        times.append(time.perf_counter() - start)
        return outputs

    engine.step = timed
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--sort", default="tottime", help="pstats order for --profile")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--async-scheduling", choices=["on", "off", "auto"], default="auto")
    args = parser.parse_args()


    from octavo import LLM, SamplingParams

    options = {} if args.async_scheduling == "auto" else {
        "async_scheduling": args.async_scheduling == "on"
    }
    llm = host_only_llm(LLM, **options)
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randint(2, 1000) for _ in range(args.prompt_len)]}
        for _ in range(args.num_seqs)
    ]
    params = [
        SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=args.max_tokens)
        for _ in range(args.num_seqs)
    ]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    steps_before = llm.get_stats()["num_steps"]
    step_times = time_steps(llm.engine)
    profile = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    if profile:
        profile.enable()
    llm.generate(prompts, params, use_tqdm=False)
    if profile:
        profile.disable()
    seconds = time.perf_counter() - start
    steps = llm.get_stats()["num_steps"] - steps_before
    print(
        f"{args.num_seqs} seqs x {args.max_tokens} tokens: {seconds:.2f} s, {steps} steps, "
        f"{1e3 * seconds / steps:.2f} ms per step, median step "
        f"{1e3 * statistics.median(step_times):.2f} ms"
    )
    if profile:
        pstats.Stats(profile).sort_stats(args.sort).print_stats(args.top)


if __name__ == "__main__":
    main()
