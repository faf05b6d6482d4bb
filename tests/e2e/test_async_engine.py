"""AsyncEngine.build: the Engine is built and stepped on one thread, and `octavo serve
--engine-in-thread` uses it (by default `octavo serve` runs the Engine in a process of its
own: test_engine_process.py).

Why it matters (async_engine.py): on the CPU, torch's OpenMP pool belongs to the thread that
runs the parallel ops, and a second pool on the same cores makes every op wait for a worker
to wake up. The speed is measured in docs/PERFORMANCE.md; these tests check the threads.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import threading
import types

import pytest

from octavo.engine.async_engine import AsyncEngine
from octavo.outputs import CompletionOutput, RequestOutput
from octavo.sampling_params import RequestOutputKind, SamplingParams


def test_build_steps_the_engine_on_the_thread_that_built_it():
    from octavo.engine.builder import build_engine

    built_on = []

    def make_engine():
        built_on.append(threading.get_ident())
        return build_engine(num_kv_blocks=64)  # a small KV cache is enough for two requests

    async_engine = AsyncEngine.build(make_engine)
    assert built_on and built_on[0] != threading.get_ident()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    async def serve_one() -> tuple[int, list[int]]:
        async_engine.start()
        try:
            stepped_on = await async_engine.call(lambda engine: threading.get_ident())
            outputs = [out async for out in async_engine.generate("Hello", params, "r0")]
            # an id like the engine's own, n = 2 (whose sequences the engine calls id#i)
            two = [o async for o in async_engine.generate("Hi", two_samples, "r0#1")]
        finally:
            await async_engine.shutdown()
        assert {o.request_id for o in outputs + two} == {"r0", "r0#1"}
        assert [len(c.token_ids) for c in two[-1].outputs] == [4, 4]
        return stepped_on, outputs[-1].outputs[0].token_ids

    two_samples = SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=0, ignore_eos=True)
    stepped_on, token_ids = asyncio.run(serve_one())
    assert stepped_on == built_on[0]
    assert len(token_ids) == 4
    assert not async_engine.is_running


@pytest.mark.slow  # builds an engine of its own
def test_outputs_and_failures_leave_the_engine_thread_after_their_steps_stats():
    """Whoever holds a request's last output, or its failure, sees stats in which the request
    is gone and its blocks are free (the engine process sends both in one message; the
    thread must update its snapshot before it posts them)."""
    from octavo.engine.async_engine import EngineStepError
    from octavo.engine.builder import build_engine

    async_engine = AsyncEngine.build(functools.partial(build_engine, num_kv_blocks=64))
    free_before = async_engine.stats["kv_blocks_free"]
    seen: dict[str, list[dict]] = {"finished": [], "failed": []}
    post = async_engine._post

    def spy(fn, *args):  # runs on the engine thread, as it posts
        if fn == async_engine._dispatch and any(out.finished for out in args[0]):
            seen["finished"].append(dict(async_engine.stats))
        elif fn == async_engine._fail:
            seen["failed"].append(dict(async_engine.stats))
        post(fn, *args)

    calls = []

    def explode_on_second_step(runner):
        step = runner.execute_async

        def execute_async(*args, **kwargs):  # the request holds blocks when it fails
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("injected failure")
            return step(*args, **kwargs)

        runner.execute_async = execute_async

    async_engine._post = spy
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    async def serve_two() -> None:
        async_engine.start()
        try:
            _ = [out async for out in async_engine.generate("Hello there", params, "ok")]
            await async_engine.call(lambda engine: explode_on_second_step(engine.runner))
            with pytest.raises(EngineStepError, match="injected failure"):
                _ = [out async for out in async_engine.generate("Hello again", params, "bad")]
        finally:
            await async_engine.shutdown()

    asyncio.run(serve_two())
    assert [len(seen["finished"]), len(seen["failed"])] == [1, 1]
    for stats in seen["finished"] + seen["failed"]:
        assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
        assert stats["kv_blocks_free"] == free_before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's madvise zeroes pages")
def test_an_idle_loop_gives_the_free_kv_blocks_memory_back():
    """After `kv_idle_release_s` idle, the prefix cache is empty, the free blocks read zeros
    (their pages went back to the system), and the next request answers as before."""
    from octavo.engine.builder import build_engine

    make_engine = functools.partial(build_engine, num_kv_blocks=64)
    async_engine = AsyncEngine.build(make_engine, kv_idle_release_s=1.0)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = "The quick brown fox jumps over the lazy dog. " * 4  # full blocks to cache

    def kv_state(engine) -> tuple[int, float]:
        return len(engine.kv.pool.cached_blocks), sum(
            c.abs().sum().item() for c in engine.runner.kv_caches
        )

    async def serve() -> tuple:
        async_engine.start()
        try:
            first = [o async for o in async_engine.generate(prompt, params, "a")][-1]
            used = await async_engine.call(kv_state)
            await asyncio.sleep(2.0)
            idle = await async_engine.call(kv_state)
            again = [o async for o in async_engine.generate(prompt, params, "b")][-1]
        finally:
            await async_engine.shutdown()
        return first, used, idle, again

    first, used, idle, again = asyncio.run(serve())
    assert used[0] > 0 and used[1] > 0
    assert idle == (0, 0.0)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_idle_release_waits_only_after_a_step_and_never_at_zero():
    from octavo.engine.engine_loop import IdleRelease

    released = []
    engine = types.SimpleNamespace(release_kv_memory=lambda: released.append(1) or 0)
    with pytest.raises(ValueError, match="kv_idle_release_s"):
        IdleRelease(engine, -1.0)
    idle = IdleRelease(engine, 30.0)
    assert idle.timeout() is None  # nothing ran yet: nothing to give back
    idle.stepped = True
    assert idle.timeout() == 30.0
    idle.release()
    assert released == [1] and idle.timeout() is None  # once per idle spell
    never = IdleRelease(engine, 0)
    never.stepped = True
    assert never.timeout() is None


def test_build_raises_the_factory_error_on_the_callers_thread():
    def make_engine():
        raise ValueError("no such model: 'nowhere'")

    before = threading.active_count()
    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine.build(make_engine)
    assert threading.active_count() == before


def _fake_engine():
    return types.SimpleNamespace(
        get_stats=dict, scheduler_config=types.SimpleNamespace(max_model_len=64)
    )


def test_a_built_engine_that_never_started_shuts_down():
    async_engine = AsyncEngine.build(_fake_engine)
    thread = async_engine._thread
    assert not async_engine.is_running
    asyncio.run(async_engine.shutdown())
    assert not thread.is_alive()


def test_no_request_is_taken_once_the_engine_loop_has_ended():
    """The engine loop tells the event loop it has ended (`_close`) before its thread exits;
    a request that comes in between fails at once instead of waiting for ever."""
    async_engine = AsyncEngine(_fake_engine())
    async_engine._thread = types.SimpleNamespace(is_alive=lambda: True)  # not exited yet

    async def scenario():
        async_engine._loop = asyncio.get_running_loop()
        assert async_engine.is_running
        async_engine._close(RuntimeError("the engine loop died"))
        with pytest.raises(RuntimeError, match="not running"):
            await anext(async_engine.generate([1], SamplingParams(), "late"))
        assert async_engine._commands.empty()

    asyncio.run(scenario())


def test_a_late_output_of_an_aborted_request_never_reaches_its_ids_next_user():
    """The engine thread posts a step's outputs to the event loop; one posted for a request
    whose consumer has since left must not reach a new request under the same id."""
    async_engine = AsyncEngine(_fake_engine())
    async_engine._thread = types.SimpleNamespace(is_alive=lambda: True)  # no real loop
    params = SamplingParams(max_tokens=2, output_kind=RequestOutputKind.DELTA)

    def output(engine_id: str, text: str) -> RequestOutput:
        return RequestOutput(engine_id, None, [1], [CompletionOutput(0, text, [5])])

    async def scenario():
        async_engine._loop = asyncio.get_running_loop()
        old = async_engine.generate([1], params, "x")
        waiting = asyncio.ensure_future(anext(old))
        await asyncio.sleep(0)
        assert async_engine._commands.get_nowait().request_id == "0#x"
        async_engine._dispatch([output("0#x", "first")])
        assert (await waiting).request_id == "x"  # the caller's id
        await old.aclose()  # the consumer leaves: the request is aborted
        new = async_engine.generate([1], params, "x")
        waiting = asyncio.ensure_future(anext(new))
        await asyncio.sleep(0)
        assert async_engine._commands.get_nowait().request_ids == ["0#x"]
        assert async_engine._commands.get_nowait().request_id == "1#x"
        async_engine._dispatch([output("0#x", "late")])  # posted before the abort was applied
        async_engine._dispatch([output("1#x", "new")])
        assert (await waiting).outputs[0].text == "new"

    asyncio.run(scenario())


def test_abort_takes_one_id_or_several_as_the_engine_does():
    async_engine = AsyncEngine(_fake_engine())
    async_engine._thread = types.SimpleNamespace(is_alive=lambda: True)  # no real loop

    async def scenario():
        async_engine._loop = asyncio.get_running_loop()
        generate = async_engine.generate([1], SamplingParams(max_tokens=2), "req7")
        waiting = asyncio.ensure_future(anext(generate))
        await asyncio.sleep(0)
        assert async_engine._commands.get_nowait().request_id == "0#req7"
        async_engine.abort("req7")  # one id, not its characters
        assert async_engine._commands.get_nowait().request_ids == ["0#req7"]
        async_engine.abort(iter(["unknown", "req7"]))
        assert async_engine._commands.get_nowait().request_ids == ["0#req7"]
        for bad in (5, [5], None, ["req7", b"req7"]):
            with pytest.raises(ValueError, match="request_ids must be a str or an iterable"):
                async_engine.abort(bad)
        assert async_engine._commands.empty()
        waiting.cancel()

    asyncio.run(scenario())


def test_serve_in_thread_builds_its_engine_on_the_engine_thread(monkeypatch):
    import octavo.engine.builder
    from octavo.entrypoints import cli
    from octavo.entrypoints.openai.lifecycle import Server

    built_on, served = [], []

    def fake_build_engine(*args, **kwargs):
        built_on.append(threading.current_thread())
        return _fake_engine()

    monkeypatch.setattr(octavo.engine.builder, "build_engine", fake_build_engine)
    monkeypatch.setattr(Server, "run", lambda self: served.append(self.config.app))
    args = cli.build_parser().parse_args(["serve", "--engine-in-thread"])
    assert args.func(args) == 0
    (async_engine,) = (app.state.ctx.engine for app in served)
    assert built_on == [async_engine._thread]
    assert built_on[0] is not threading.main_thread()
    asyncio.run(async_engine.shutdown())
