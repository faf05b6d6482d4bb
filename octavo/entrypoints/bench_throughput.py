"""`octavo bench throughput`: offline generation throughput against a peer in the same run.

Workloads:
- `cpu`: the embedded model (float32), 32 prompts of mixed length, mixed max_tokens,
  greedy, ignore_eos. Peer `hf`: transformers' left-padded batched `generate`, which must
  run every sequence to the batch's longest max_tokens; only each request's own max_tokens
  count as output for both.
- `single`: one request of the `cpu` workload's kind (64 prompt tokens, 128 greedy output
  tokens): single-stream decode; peer `hf`: `generate` on the one prompt.
- `nanovllm`: the nano-vllm workload, as nano-vllm's bench.py (256 requests, random token ids,
  temperature 0.6, ignore_eos), for a dummy-weight model such as the bundled `qwen3-0.6b`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from octavo.entrypoints.cli_args import (
    add_load_args,
    add_parallel_args,
    add_step_args,
    engine_options,
    positive_int,
)


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]
    temperature: float

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)

    def describe(self, name: str) -> str:
        """One line: the prompts, their lengths and the output tokens asked for."""
        lengths, outs = [len(p) for p in self.prompts], self.max_tokens
        sampling = "greedy" if self.temperature == 0 else f"temperature {self.temperature}"
        return (
            f"workload {name}: {len(lengths)} prompts of {min(lengths)}-{max(lengths)} random "
            f"token ids ({sum(lengths)} in all), {min(outs)}-{max(outs)} output tokens each "
            f"({sum(outs)} in all, EOS ignored), {sampling}"
        )


def cpu_workload(vocab_size: int, num_prompts: int = 32, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts = [
        [rng.randint(100, vocab_size - 1) for _ in range(rng.randint(16, 256))]
        for _ in range(num_prompts)
    ]
    return Workload(prompts, [rng.randint(16, 128) for _ in range(num_prompts)], 0.0)


def single_workload(vocab_size: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    return Workload([[rng.randint(100, vocab_size - 1) for _ in range(64)]], [128], 0.0)


def nanovllm_workload(num_seqs: int = 256) -> Workload:
    """Exactly nano-vllm's bench.py: prompts first, then output lengths, from seed 0."""
    random.seed(0)
    max_input_len = max_output_len = 1024
    prompts = [
        [random.randint(0, 10000) for _ in range(random.randint(100, max_input_len))]
        for _ in range(num_seqs)
    ]
    max_tokens = [random.randint(100, max_output_len) for _ in range(num_seqs)]
    return Workload(prompts, max_tokens, 0.6)


@dataclass
class Result:
    engine: str
    output_tokens: int
    seconds: float

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.seconds


def run_octavo(llm, w: Workload, progress: bool = False) -> Result:
    from octavo.sampling_params import SamplingParams

    params = [
        SamplingParams(temperature=w.temperature, ignore_eos=True, max_tokens=m)
        for m in w.max_tokens
    ]
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in w.prompts], params, use_tqdm=progress)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == w.num_output_tokens, (produced, w.num_output_tokens)
    return Result("octavo", produced, seconds)


def run_hf_generate(model_path: str, w: Workload) -> Result:
    """transformers' batched generate with left padding, greedy, float32 on the CPU."""

    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {}
    if model_path.endswith(".gguf"):
        kwargs["gguf_file"] = os.path.basename(model_path)
        model_path = os.path.dirname(model_path)
    with _quiet_stderr():  # its GGUF conversion bars would land in our table
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, **kwargs)
    model.eval()
    pad = 0
    width = max(len(p) for p in w.prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in w.prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in w.prompts])
    gen = dict(do_sample=False, pad_token_id=pad, eos_token_id=None)
    with torch.inference_mode():
        model.generate(ids[:1, -8:], attention_mask=mask[:1, -8:], max_new_tokens=4, **gen)
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=max(w.max_tokens), **gen)
        seconds = time.perf_counter() - start
    return Result("hf-generate", w.num_output_tokens, seconds)


@contextlib.contextmanager
def _quiet_stderr():
    """Sends what is written to the process's stderr (file descriptor 2) to a file while
    open; prints it if the block raises."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            captured.seek(0)
            sys.stderr.write(captured.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def run_hf_continuous_batching(model_dir: str, w: Workload, timeout_s: float) -> Result:
    """transformers' continuous batching (paged attention, sdpa) on dummy weights, CUDA.

    Stops waiting after `timeout_s` and reports the tokens finished so far over the time
    taken (the peer is slow, and device time is scarce); `engine` says when that happened.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    # NOTE: built on the GPU: the random init of an 8B model on the CPU outlasts a benchmark.
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            cfg, dtype=torch.bfloat16, attn_implementation="paged|sdpa"
        )
    model = model.eval()
    gen = GenerationConfig(
        max_new_tokens=max(w.max_tokens),
        do_sample=True,
        temperature=0.6,
        eos_token_id=-1,
        pad_token_id=0,
    )
    done = tokens = 0
    # NOTE: at the timeout the unfinished requests are cancelled, so that leaving the context
    # (which joins HF's generation thread) does not wait for them.
    with model.continuous_batching_context_manager(generation_config=gen, timeout=60) as manager:
        start = time.perf_counter()
        pending = {
            manager.add_request(ids, max_new_tokens=n)
            for ids, n in zip(w.prompts, w.max_tokens, strict=True)
        }
        while pending and time.perf_counter() - start < timeout_s:
            result = manager.get_result(timeout=1.0)
            if result is None or not result.is_finished():
                continue
            pending.discard(result.request_id)
            done += 1
            tokens += len(result.generated_tokens)
        seconds = time.perf_counter() - start
        for request_id in pending:
            manager.cancel_request(request_id)
    name = "hf-cb" if done == len(w.prompts) else f"hf-cb({done}/{len(w.prompts)} req)"
    return Result(name, tokens, seconds)


def _report_floor(fl, ceil, seconds: float) -> dict:
    """Prints the floor and the serial floor against octavo's `seconds`; their JSON entry."""
    print(
        f"floor {fl.seconds:.2f} s (memory {fl.memory_s:.2f}, compute {fl.compute_s:.2f}; "
        f"copy {ceil.copy_bytes_per_s / 1e12:.2f} TB/s{_sizes(ceil)}, matmul "
        f"{ceil.matmul_flops / 1e12:.0f} TFLOP/s): octavo at {fl.seconds / seconds:.1%} of "
        "the floor"
    )
    print(
        f"serial floor {fl.serial_s:.2f} s (kernels in turn, any schedule: decode KV reads, "
        f"then GEMMs at max(weight reads, all FLOPs)): octavo at {fl.serial_s / seconds:.1%} "
        f"of it; FCFS serial estimate {fl.fcfs_serial_s:.2f} s (prompts first, then lockstep "
        f"decode): {fl.fcfs_serial_s / seconds:.1%}"
    )
    return {"floor": asdict(fl) | {"seconds": fl.seconds} | asdict(ceil)}


def cmd_throughput(args: argparse.Namespace) -> int:
    from octavo.entrypoints.llm import LLM

    options = engine_options(args)
    if args.workload == "nanovllm" and args.max_num_batched_tokens is None:
        # nano-vllm's own setting (vLLM's offline default on an 80 GB GPU is the same)
        options["max_num_batched_tokens"] = 16384
    llm = LLM(args.model, **options)
    vocab = llm.engine.vocab_size
    if args.workload == "nanovllm":
        w = nanovllm_workload()
    elif args.workload == "single":
        w = single_workload(vocab)
    else:
        w = cpu_workload(vocab, args.num_prompts)
    print(w.describe(args.workload))
    print(f"{'engine':<22}{'out tokens':>12}{'seconds':>10}{'tok/s':>10}")
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    results = [_report(run_octavo(llm, w, progress))]
    spec = _report_speculation(llm.get_stats())
    # The floor times this process's GPU; with tensor parallelism it holds no model.
    on_gpu = llm.engine.runner.device.type == "cuda" and args.tensor_parallel_size == 1
    floor = measured_floor(llm, w) if on_gpu else None
    report: dict = {} if floor is None else _report_floor(*floor, results[0].seconds)
    if spec:
        report["speculation"] = spec
    if args.peer == "hf":
        from octavo.engine.builder import resolve_model

        path = resolve_model(args.model)
        if llm.engine.runner.device.type == "cuda":
            import gc

            import torch

            del llm  # the peer needs the GPU memory
            gc.collect()
            torch.cuda.empty_cache()
            results.append(_report(run_hf_continuous_batching(path, w, args.peer_timeout)))
        else:
            results.append(_report(run_hf_generate(path, w)))
    report["results"] = [asdict(r) | {"tok_per_s": r.tok_per_s} for r in results]
    if len(results) > 1:
        print(f"octavo / {results[1].engine}: {results[0].tok_per_s / results[1].tok_per_s:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _report_speculation(stats: dict) -> dict:
    """Prints what speculative decoding kept, if it ran; returns its counters."""
    spec = {k: v for k, v in stats.items() if k.startswith("spec_")}
    if spec:
        print(f"speculation: mean accepted length {spec['spec_mean_accepted_length']:.2f} "
              f"({spec['spec_accepted_tokens']} of {spec['spec_draft_tokens']} guesses kept, "
              f"by position {spec['spec_accepted_per_position']})")  # fmt: skip
    return spec


def _report(r: Result) -> Result:
    print(f"{r.engine:<22}{r.output_tokens:>12}{r.seconds:>10.2f}{r.tok_per_s:>10.1f}", flush=True)
    return r


def _sizes(ceil) -> str:
    """' (best of 1 GiB 4.17, 2 GiB 4.22)': the copy rate of each buffer size timed."""
    if len(ceil.copy_by_size) < 2:
        return ""
    rates = ", ".join(f"{s >> 30} GiB {r / 1e12:.2f}" for s, r in ceil.copy_by_size.items())
    return f" (best of {rates})"


def measured_floor(llm, w: Workload):
    """(the workload's floor, the ceilings it was measured with) on the engine's device."""
    from octavo.entrypoints.bench_floor import measure_ceilings, workload_floor

    runner = llm.engine.runner
    ceilings = measure_ceilings(runner.dtype)
    prompt_lens = [len(p) for p in w.prompts]
    fl = workload_floor(
        runner.model, runner.hf_config, runner.kv_cache_dtype, prompt_lens, w.max_tokens, ceilings
    )
    return fl, ceilings


def add_parser(sub) -> None:
    p = sub.add_parser("throughput", help="offline generation throughput")
    p.add_argument(
        "--model", default=None,
        help="as `octavo generate --model` (default: the embedded SmolLM2-135M-Instruct)",
    )  # fmt: skip
    add_load_args(p)
    p.add_argument(
        "--workload", default="cpu", choices=["cpu", "single", "nanovllm"],
        help="cpu: --num-prompts random prompts of 16-256 tokens, 16-128 greedy tokens each; "
        "single: one of 64 tokens, 128 out; nanovllm: nano-vllm's 256 of 100-1,024 tokens",
    )  # fmt: skip
    p.add_argument(
        "--num-prompts", type=positive_int, default=32, help="prompts of the cpu workload"
    )
    add_step_args(
        p,
        "16384 for --workload nanovllm, as nano-vllm; else the engine's: 8192 on a GPU, 128 "
        "on the CPU",
    )
    add_parallel_args(p)
    p.add_argument(
        "--peer", default=None, choices=["hf"], help="also time HF transformers on the workload"
    )
    p.add_argument("--peer-timeout", type=float, default=300.0, help="seconds (GPU peer)")
    p.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=None,
        help="a progress bar on the timed run (default: when stderr is a terminal)",
    )  # fmt: skip
    p.add_argument("--json", default=None, help="write the results here")
    p.set_defaults(func=cmd_throughput)
