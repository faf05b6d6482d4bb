"""The engine's handle on its tensor-parallel workers: ModelRunner's interface over one
connection per worker (runner/worker.py).

The engine sends each step's SchedulerOutput, pickled once, to every worker; rank 0 sends
back the step's tokens when the engine asks for them. Workers on this node are spawned here;
workers on other nodes connect from `octavo serve --node-rank R` (see launch_node).

A worker that dies or fails is found while the engine waits for any answer (its connection
closes) or sends (the pipe breaks): the engine then stops every other worker and raises
WorkerDied, now and on every later call.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import replace
from multiprocessing.connection import Connection, Listener, wait

import torch

from octavo.core.sched_output import GrammarBitmask, SchedulerOutput
from octavo.kernels.capability import usable_cores
from octavo.runner.interface import Runner
from octavo.runner.outputs import ModelRunnerOutput
from octavo.runner.worker import authkey, no_delay, split_addr

DIST_TIMEOUT_S = 600.0  # a collective that waits longer than this fails its worker
STOP_GRACE_S = 5.0


class WorkerDied(RuntimeError):
    """A tensor-parallel worker is gone or failed; the engine cannot go on."""


def free_port() -> int:
    """A TCP port free on this host now, outside the kernel's ephemeral range where it can:
    a client that retries connecting to an ephemeral port before its server listens may be
    given that very port as its own source and connect to itself, and the server then fails
    with EADDRINUSE."""
    low, high = _ephemeral_ports()
    outside = [p for p in range(20000, 32768) if not low <= p <= high]
    for port in random.sample(outside, min(32, len(outside))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # all taken: any port the kernel gives
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_ports() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
    except (OSError, ValueError):  # not Linux: the IANA range
        return 49152, 65535
    return low, high


def launch_workers(
    ranks: range, world_size: int, connect: str, dist_addr: str
) -> list[subprocess.Popen]:
    """Starts one worker process per rank of this node (local rank = position in `ranks`),
    importing octavo from where this process does."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    procs = []
    for local, rank in enumerate(ranks):
        args = [f"--rank={rank}", f"--world-size={world_size}", f"--local-rank={local}"]
        command = [sys.executable, "-m", "octavo.runner.worker", f"--connect={connect}"]
        procs.append(subprocess.Popen([*command, f"--dist-addr={dist_addr}", *args], env=env))
    return procs


def launch_node(tensor_parallel_size: int, nnodes: int, node_rank: int, dist_init_addr: str) -> int:
    """Runs the workers of node `node_rank` > 0 until they exit; returns the worst exit code.
    The engine and API run on node 0, which listens on `dist_init_addr`."""
    host, port = split_addr(dist_init_addr)
    per_node = tensor_parallel_size // nnodes
    ranks = range(node_rank * per_node, (node_rank + 1) * per_node)
    procs = launch_workers(ranks, tensor_parallel_size, dist_init_addr, f"{host}:{port + 1}")
    try:
        return max(proc.wait() for proc in procs)
    finally:
        _kill(procs)


class _RemotePending:
    """A step launched on the workers; `result()` asks rank 0 for its tokens."""

    def __init__(self, runner: MultiprocRunner, step_id: int) -> None:
        self.runner, self.step_id = runner, step_id

    def result(self) -> ModelRunnerOutput:
        return self.runner._call_first("result", self.step_id)


class MultiprocRunner(Runner):
    """ModelRunner's interface for `tensor_parallel_size` workers, spread evenly over
    `nnodes` nodes; this process is on node 0 and holds no model."""

    pin_host_memory = False

    def __init__(
        self,
        runner_options: dict,
        device_type: str,
        tensor_parallel_size: int,
        nnodes: int = 1,
        dist_init_addr: str | None = None,
        expert_parallel: bool = False,
    ) -> None:
        self.hf_config = runner_options["hf_config"]
        self.dtype = runner_options["dtype"]
        self.kv_cache_dtype = runner_options["kv_cache_dtype"]
        self.vocab_size = self.hf_config.vocab_size
        self.device = torch.device(device_type)
        self.size = tensor_parallel_size
        self.dead: str | None = None
        self._unsent: SchedulerOutput | None = None  # a step to send with its sampling
        self._inbox: list[deque] = [deque() for _ in range(tensor_parallel_size)]
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._conns)
        if dist_init_addr is None:
            host, port = "127.0.0.1", 0
            listener = Listener((host, port), authkey=authkey())
            connect = f"{host}:{listener.address[1]}"
            dist_addr = f"{host}:{free_port()}"
        else:
            host, port = split_addr(dist_init_addr)
            listener = Listener(("0.0.0.0", port), authkey=authkey())
            connect, dist_addr = dist_init_addr, f"{host}:{port + 1}"
        try:
            per_node = tensor_parallel_size // nnodes
            self._procs += launch_workers(range(per_node), tensor_parallel_size, connect, dist_addr)
            self._conns += self._accept(listener)
        finally:
            listener.close()
        threads = None if device_type == "cuda" else max(1, usable_cores() // per_node)
        options = {
            "runner": runner_options,
            "device_type": device_type,
            "nnodes": nnodes,
            "timeout_s": DIST_TIMEOUT_S,
            "cpu_threads": threads if "OMP_NUM_THREADS" not in os.environ else None,
            "expert_parallel": expert_parallel,
        }
        for conn in self._conns:
            conn.send(options)
        self._receive_all()  # each has built its shard

    def _accept(self, listener: Listener) -> list[Connection]:
        """Every worker's connection, in rank order; fails if a local worker exits first."""
        conns: dict[int, Connection] = {}
        errors: list[BaseException] = []

        def accept() -> None:
            try:
                while len(conns) < self.size:
                    conn = no_delay(listener.accept())
                    conns[conn.recv()] = conn
            except BaseException as e:  # noqa: BLE001 - the listener closed, or a bad handshake
                errors.append(e)

        thread = threading.Thread(target=accept, name="octavo-tp-accept", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            for rank, proc in enumerate(self._procs):
                if proc.poll() is not None:
                    _stop(self._procs, list(conns.values()))
                    raise WorkerDied(f"tensor-parallel worker rank {rank} exited at start-up")
        if errors:
            _stop(self._procs, list(conns.values()))
            raise WorkerDied(f"tensor-parallel workers failed to connect: {errors[0]}")
        return [conns[rank] for rank in range(self.size)]

    # ModelRunner's interface, as the engine and the builder use it.

    def num_kv_blocks(self, cache, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        """Each worker sizes its cache, and all agree on the smallest count."""
        self._send("size", (cache, max_num_batched_tokens, max_num_seqs))
        return self._receive_all()[0]  # all the same

    def allocate_kv_cache(self, *args) -> None:
        self._send("allocate", args)
        self._receive_all()

    def execute_async(self, so: SchedulerOutput) -> _RemotePending:
        """A structured step's forward starts on the workers now (its bitmask may come
        later); any other goes with its sample_tokens, which follows at once: one message."""
        if so.structured_request_ids:
            self._send("execute", so)
        else:
            self._unsent = so
        return _RemotePending(self, so.step_id)

    def sample_tokens(self, grammar_bitmask: GrammarBitmask | None) -> None:
        if grammar_bitmask is not None:  # a view of the engine's buffer: send its rows
            grammar_bitmask = replace(grammar_bitmask, bitmask=grammar_bitmask.bitmask.clone())
        so, self._unsent = self._unsent, None
        if so is not None:
            self._send("step", so)
        else:
            self._send("sample", grammar_bitmask)

    def cancel_held(self) -> None:
        self._unsent = None
        if self.dead is None:
            self._send("cancel", None)

    def release_kv_blocks(self, ids: dict[bool, list[int]]) -> int:
        """Each worker gives these free blocks' memory back (ModelRunner's): the bytes, summed."""
        self._send("release", ids)
        return sum(self._receive_all())

    def profile(self, prefix: str | None = None, trace: bool = False) -> list[str]:
        """Starts cProfile (`trace`: torch.profiler's device trace) on every worker (no
        prefix), or stops it and has rank R write it to `{prefix}.rank{R}`; returns those
        paths."""
        paths = [f"{prefix}.rank{rank}" for rank in range(self.size)] if prefix else []
        self._check()
        for rank in range(self.size):
            path = paths[rank] if paths else None
            self._send_bytes(rank, pickle.dumps(("profile", (path, trace))))
        self._receive_all()
        return paths

    def shutdown(self) -> None:
        self._finalizer()

    # Messages.

    def _send(self, op: str, arg) -> None:
        self._check()
        data = pickle.dumps((op, arg), protocol=pickle.HIGHEST_PROTOCOL)
        for rank in range(self.size):
            self._send_bytes(rank, data)

    def _call_first(self, op: str, arg):
        self._check()
        self._send_bytes(0, pickle.dumps((op, arg)))
        return self._receive(0)

    def _send_bytes(self, rank: int, data: bytes) -> None:
        try:
            self._conns[rank].send_bytes(data)
        except OSError:
            self._die(f"tensor-parallel worker rank {rank} is gone{self._exit_code(rank)}")

    def _receive(self, rank: int):
        """Waits for `rank`'s answer, watching every other worker meanwhile (an answer of
        another rank waits in its inbox)."""
        while not self._inbox[rank]:
            for conn in wait(self._conns, timeout=1.0):
                sender = self._conns.index(conn)
                try:
                    tag, value = conn.recv()
                except (EOFError, OSError):
                    self._die(f"tensor-parallel worker rank {sender} died{self._exit_code(sender)}")
                if tag == "error":
                    cause = self._other_death(sender)
                    self._die(cause or f"tensor-parallel worker rank {sender} failed: {value}")
                self._inbox[sender].append(value)
            dead = self._dead_worker()
            if dead is not None:
                self._die(dead)
        return self._inbox[rank].popleft()

    def _receive_all(self) -> list:
        """Every rank's answer, in rank order."""
        return [self._receive(rank) for rank in range(self.size)]

    def _dead_worker(self, other_than: int | None = None) -> str | None:
        """Which local worker (other than `other_than`) has exited, as the error to report."""
        for rank, proc in enumerate(self._procs):
            if rank != other_than and proc.poll() is not None:
                return f"tensor-parallel worker rank {rank} died{self._exit_code(rank)}"
        return None

    def _other_death(self, sender: int, wait_s: float = 1.0) -> str | None:
        """A local worker other than `sender` that has died, seen within `wait_s`: a
        collective that lost its peer fails on the survivors too, and the one that died is
        the cause to report."""
        deadline = time.monotonic() + wait_s
        while (dead := self._dead_worker(sender)) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return dead

    def _exit_code(self, rank: int) -> str:
        if rank >= len(self._procs):
            return ""
        try:
            return f" (exit code {self._procs[rank].wait(1.0)})"
        except subprocess.TimeoutExpired:
            return ""

    def _check(self) -> None:
        if self.dead is not None:
            raise WorkerDied(self.dead)

    def _die(self, message: str):
        self.dead = message
        _kill(self._procs)
        self._finalizer()
        raise WorkerDied(message)


def _stop(procs: list[subprocess.Popen], conns: list[Connection]) -> None:
    """Asks the workers to stop, then kills whichever has not within STOP_GRACE_S."""
    data = pickle.dumps(("stop", None))
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.send_bytes(data)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(STOP_GRACE_S)
    _kill(procs)
    for conn in conns:
        conn.close()


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
