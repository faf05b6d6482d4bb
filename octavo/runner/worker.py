"""A tensor-parallel worker: one process per rank, holding its model shard and KV cache and
running the steps the engine sends (runner/multiproc.py).

    python -m octavo.runner.worker --connect HOST:PORT --dist-addr HOST:PORT \\
        --rank R --world-size N --local-rank L

Every worker gets the same messages and runs the same ModelRunner calls; rank 0 alone
answers with a step's tokens. Answers are ("ok", value) or ("error", message). Any error ends the worker: a rank that stops mid-step would
leave the others waiting in a collective, so the engine treats it as dead and stops all.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Client, Connection

import torch
import torch.distributed as dist

from octavo.model.parallel import set_tp, use_symmetric_memory
from octavo.runner.model_runner import ModelRunner

# Shared by the engine and its workers; set OCTAVO_DIST_KEY on every node to change it.
DEFAULT_AUTHKEY = b"octavo-tensor-parallel"
CONNECT_TIMEOUT_S = 300.0  # how long a worker waits for the engine's node to come up


def authkey() -> bytes:
    key = os.environ.get("OCTAVO_DIST_KEY")
    return key.encode() if key else DEFAULT_AUTHKEY


def split_addr(addr: str) -> tuple[str, int]:
    """'host:port' -> (host, port); raises ValueError naming the problem."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {addr!r}")
    return host, int(port)


def no_delay(conn: Connection) -> Connection:
    """Turns off Nagle's algorithm on a TCP connection: a step's message is often two
    writes, and the second would wait for the first's acknowledgement (40 ms)."""
    with socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def connect(addr: str, timeout_s: float = CONNECT_TIMEOUT_S) -> Connection:
    """Connects to the engine, retrying while its node starts."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return no_delay(Client(split_addr(addr), authkey=authkey()))
        except (ConnectionRefusedError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def init_distributed(args, options: dict) -> torch.device:
    """Joins the process group (NCCL on CUDA, gloo on the CPU) and sets the layers' group."""
    if options["device_type"] == "cuda":
        device = torch.device("cuda", args.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://{args.dist_addr}",
        rank=args.rank,
        world_size=args.world_size,
        timeout=timedelta(seconds=options["timeout_s"]),
        device_id=device if device.type == "cuda" else None,
    )
    set_tp(args.rank, args.world_size, dist.group.WORLD, options.get("expert_parallel", False))
    # Peers' memory is reachable within a node.
    if device.type == "cuda" and options.get("nnodes", 1) == 1:
        use_symmetric_memory(device)
    return device


def serve(conn: Connection, args) -> None:
    """Builds the shard from the engine's options, then runs its messages until "stop"."""
    options = conn.recv()
    if options.get("cpu_threads"):
        torch.set_num_threads(options["cpu_threads"])
    device = init_distributed(args, options)
    runner = ModelRunner(device=device, **options["runner"])
    conn.send(("ok", None))
    pending = {}  # rank 0: step id -> its PendingOutput, until the engine takes the result
    profiler = None
    while True:
        op, arg = pickle.loads(conn.recv_bytes())
        if op in ("step", "execute"):  # "step": executed and sampled, no bitmask
            out = runner.execute_async(arg)
            if op == "step":
                runner.sample_tokens(None)
            if args.rank == 0:
                pending[arg.step_id] = out
        elif op == "result":  # steps the engine dropped unread go with it
            for step_id in [s for s in pending if s <= arg]:
                out = pending.pop(step_id)
            conn.send(("ok", out.result()))
        elif op == "sample":
            runner.sample_tokens(arg)
        elif op == "cancel":
            runner.cancel_held()
        elif op == "release":
            conn.send(("ok", runner.release_kv_blocks(arg)))
        elif op == "size":
            count = torch.tensor([runner.num_kv_blocks(*arg)], device=device)
            dist.all_reduce(count, op=dist.ReduceOp.MIN)  # every rank keeps the same blocks
            conn.send(("ok", int(count.item())))
        elif op == "allocate":
            runner.allocate_kv_cache(*arg)
            conn.send(("ok", None))
        elif op == "profile":
            profiler = _profile(profiler, arg)
            conn.send(("ok", None))
        elif op == "stop":
            return


def _profile(profiler, arg: tuple[str | None, bool]):
    """Starts profiling this worker's loop (path None), or stops and writes to `path`: cProfile
    stats of where its host time goes, or with `trace` torch.profiler's device trace (Chrome
    trace JSON)."""
    import cProfile

    from torch.profiler import ProfilerActivity, profile

    path, trace = arg
    if profiler is not None:
        if trace:
            profiler.__exit__(None, None, None)
            profiler.export_chrome_trace(path)
        else:
            profiler.disable()
            profiler.dump_stats(path)
        return None
    if trace:
        cuda = torch.cuda.is_available()
        profiler = profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])
        profiler.__enter__()
    else:
        profiler = cProfile.Profile()
        profiler.enable()
    return profiler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m octavo.runner.worker")
    parser.add_argument("--connect", required=True, help="the engine's HOST:PORT")
    parser.add_argument("--dist-addr", required=True, help="torch.distributed's HOST:PORT")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--local-rank", type=int, default=0)
    args = parser.parse_args(argv)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints where a worker waits
    conn = connect(args.connect)
    conn.send(args.rank)
    try:
        serve(conn, args)
    except (EOFError, ConnectionError):  # the engine went away
        os._exit(0)
    except BaseException as e:  # noqa: BLE001 - reported to the engine, then the worker ends
        traceback.print_exc()
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(e).__name__}: {e}"))
        # NOTE: no clean-up: tearing down a group whose peer is gone may wait on it forever.
        os._exit(1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
