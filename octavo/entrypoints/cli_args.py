"""What every `octavo` command shares: its parser (one-line errors, defaults shown once in
--help), integer checks, and the tensor-parallel options."""

from __future__ import annotations

import argparse
import json

from octavo.config import KV_CACHE_DTYPES, LOAD_FORMATS
from octavo.quant import QUANTIZATION_CHOICES


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default once: not where it is None or off, nor where the help
    says it already."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        if action.default is None or action.default is False or "default" in help_text:
            return action.help
        return super()._get_help_string(action)


def add_load_args(p: argparse.ArgumentParser) -> None:
    """How the model is loaded and computes: dtype, device, context length, weights, KV cache,
    determinism and CPU threads."""
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and activations; auto is bfloat16 on CUDA, float32 on the CPU",
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="the longest prompt plus output in tokens (default: the model's, within the KV cache)",
    )
    p.add_argument(
        "--load-format",
        default="auto",
        choices=LOAD_FORMATS,
        help="auto reads the weights; dummy makes random ones (for tests and benchmarks)",
    )
    p.add_argument(
        "--quantization",
        default="auto",
        choices=QUANTIZATION_CHOICES,
        help="quantize the linear layers' weights on load: int8 (W8A16), int4 (W4A16, group "
        "128) or fp8 (W8A8); gguf keeps a GGUF file's Q4_0/Q4_1/Q4_K/Q8_0 blocks; awq, gptq keep "
        "such a checkpoint's 4-bit groups; auto: the checkpoint's "
        "quantization_config, gguf for a GGUF file on the CPU, else none",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="the KV cache's dtype: auto is the model's; fp8 (= fp8_e4m3) holds twice the "
        "tokens in the same memory",
    )
    p.add_argument(
        "--deterministic", action="store_true",
        help="a request's tokens and log-probs never depend on what else runs (CUDA: "
        "batch-invariant kernels, at some speed; the CPU's float32 path always is)",
    )  # fmt: skip
    p.add_argument(
        "--threads", type=positive_int, default=None,
        help="CPU threads to compute with (default: OCTAVO_NUM_THREADS, else OMP_NUM_THREADS, "
        "else the cores this process may use, affinity and cgroup quota counted)",
    )  # fmt: skip


def add_step_args(p: argparse.ArgumentParser, batched_tokens_default: str) -> None:
    """What a step may run, and which steps replay as CUDA graphs."""
    p.add_argument(
        "--max-num-seqs", type=positive_int, default=256, help="sequences a step runs at most"
    )
    p.add_argument(
        "--max-num-batched-tokens", type=positive_int, default=None,
        help=f"tokens a step computes (default: {batched_tokens_default})",
    )  # fmt: skip
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument(
        "--cuda-graph-max-tokens", type=int_at_least(0), default=512,
        help="largest prefill or mixed step replayed as a CUDA graph (0: decode steps only)",
    )  # fmt: skip


class Parser(argparse.ArgumentParser):
    """An argument parser whose every error is one line (`octavo generate: error: ...`), as
    the commands' own checks print theirs, and whose subcommands share it."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def int_at_least(minimum: int):
    """An argparse type: an integer >= minimum, else one line naming the allowed range."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


positive_int = int_at_least(1)


def announce_threads(threads: int | None) -> None:
    """Prints, on stderr, the one line that says how many CPU threads compute and why."""
    import sys

    from octavo.kernels.capability import cpu_threads

    count, source = cpu_threads(threads)
    print(f"octavo: {count} CPU threads ({source}; --threads or OCTAVO_NUM_THREADS sets them)",
          file=sys.stderr, flush=True)  # fmt: skip


def add_parallel_args(p: argparse.ArgumentParser, nodes: bool = False) -> None:
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=positive_int,
        default=1,
        help="split the model over this many GPUs (CPU processes on the CPU), one worker each",
    )
    p.add_argument(
        "--enable-expert-parallel", action="store_true",
        help="mixture-of-experts layers: each rank holds whole experts, not a slice of each",
    )  # fmt: skip
    p.add_argument(
        "--speculative-config", type=_speculative_config, default=None, metavar="JSON",
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )  # fmt: skip
    if not nodes:
        return
    p.add_argument(
        "--nnodes", type=positive_int, default=1, help="machines the ranks are spread over"
    )
    p.add_argument(
        "--node-rank",
        type=int_at_least(0),
        default=0,
        help="this machine's index; node 0 runs the engine and the API, the others only workers",
    )
    p.add_argument(
        "--dist-init-addr",
        default=None,
        help="HOST:PORT of node 0, where every node's workers meet (PORT and PORT + 1 are used)",
    )


def _speculative_config(text: str) -> dict:
    from octavo.config import SpeculativeConfig

    try:
        SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return json.loads(text)


_ENGINE_OPTIONS = (
    "dtype", "device", "max_model_len", "load_format", "quantization", "kv_cache_dtype",
    "deterministic", "threads", "max_num_seqs", "max_num_batched_tokens", "enforce_eager",
    "cuda_graph_max_tokens", "tensor_parallel_size", "enable_expert_parallel",
    "speculative_config", "nnodes", "dist_init_addr",
)  # fmt: skip


def engine_options(args: argparse.Namespace) -> dict:
    """The options the add_*_args functions above gave the command, as build_engine's keyword
    arguments."""
    return {name: getattr(args, name) for name in _ENGINE_OPTIONS if hasattr(args, name)}
