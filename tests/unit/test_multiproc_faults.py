"""Which worker the tensor-parallel runner blames when one dies: when a worker is killed, its
peers' collectives fail too, and a survivor's error may reach the engine first. The runner
then names the dead worker, not the survivor. Stand-in workers: `sleep` processes and pipes,
so no model is needed."""

from __future__ import annotations

import signal
import subprocess
import sys
import weakref
from collections import deque
from multiprocessing import Pipe

import pytest

from octavo.runner.multiproc import MultiprocRunner, WorkerDied, _stop


def _runner(procs, conns) -> MultiprocRunner:
    runner = object.__new__(MultiprocRunner)  # the message loop only, no workers launched
    runner.size, runner.dead = len(procs), None
    runner._inbox = [deque() for _ in procs]
    runner._procs, runner._conns = procs, conns
    runner._finalizer = weakref.finalize(runner, _stop, procs, conns)
    return runner


def _workers(n: int):
    procs = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(n)
    ]
    pipes = [Pipe() for _ in range(n)]
    return procs, [p[0] for p in pipes], [p[1] for p in pipes]


def test_a_survivors_error_names_the_worker_that_died():
    procs, conns, worker_ends = _workers(2)
    procs[1].send_signal(signal.SIGKILL)
    procs[1].wait()
    worker_ends[0].send(("error", "RuntimeError: Read error: Connection reset by peer"))
    with pytest.raises(WorkerDied, match=r"rank 1 died \(exit code -9\)"):
        _runner(procs, conns)._receive(0)
    assert all(proc.poll() is not None for proc in procs)  # the survivor is stopped too


def test_an_error_with_every_worker_alive_is_the_senders():
    procs, conns, worker_ends = _workers(2)
    worker_ends[0].send(("error", "RuntimeError: boom"))
    with pytest.raises(WorkerDied, match="rank 0 failed: RuntimeError: boom"):
        _runner(procs, conns)._receive(0)
    assert all(proc.poll() is not None for proc in procs)


def test_free_port_is_outside_the_ephemeral_range(monkeypatch):
    """A port the kernel could hand a retrying client as its own source port is not chosen:
    that client would connect to itself and take the port from the server (EADDRINUSE)."""
    import socket

    from octavo.runner import multiproc

    low, high = multiproc._ephemeral_ports()
    for _ in range(5):
        port = multiproc.free_port()
        assert not low <= port <= high
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free
    monkeypatch.setattr(multiproc, "_ephemeral_ports", lambda: (1, 65535))  # nothing outside
    assert 0 < multiproc.free_port() < 65536
