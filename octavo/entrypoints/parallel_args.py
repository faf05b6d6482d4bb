"""Command-line options for tensor parallelism, shared by `serve`, `generate` and `bench`."""

from __future__ import annotations

import argparse


def add_parallel_args(p: argparse.ArgumentParser, nodes: bool = False) -> None:
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="split the model over this many GPUs (CPU processes on the CPU), one worker each",
    )
    if not nodes:
        return
    p.add_argument("--nnodes", type=int, default=1, help="machines the ranks are spread over")
    p.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this machine's index; node 0 runs the engine and the API, the others only workers",
    )
    p.add_argument(
        "--dist-init-addr",
        default=None,
        help="HOST:PORT of node 0, where every node's workers meet (PORT and PORT + 1 are used)",
    )


def parallel_options(args: argparse.Namespace) -> dict:
    """The parsed options as build_engine's keyword arguments."""
    options = {"tensor_parallel_size": args.tensor_parallel_size}
    if hasattr(args, "nnodes"):
        options.update(nnodes=args.nnodes, dist_init_addr=args.dist_init_addr)
    return options
