"""EngineProcess: `octavo serve`'s engine in a process of its own, on the embedded model.

The server's answers must be those of an in-process engine; a rejected prompt, a client that
goes away, a failed step and a dead engine process behave as with the engine on a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import types

import httpx
import pytest
from engine_utils import KV_CACHE_MEMORY
from server_fixture import ServerThread, wait_for

from octavo import CompletionOutput, RequestOutput, RequestOutputKind, SamplingParams
from octavo.engine.async_engine import AsyncEngine
from octavo.engine.engine_loop import EngineStepError, step_engine
from octavo.engine.engine_process import EngineProcess, _prompt_ids_once
from octavo.entrypoints.openai.api_server import build_app

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def served(llm):  # llm: the embedded model, only so that it is known to be installed
    engine = EngineProcess.start_process(kv_cache_memory=KV_CACHE_MEMORY)  # llm's budget
    with ServerThread(build_app(engine, MODEL)) as server:
        yield server, engine
    assert not engine._process.is_alive()  # shutdown stopped the engine process


def test_completions_match_the_engine_in_this_process(served, llm):
    server, engine = served
    # What the server checks requests against comes over the pipe at start-up.
    assert engine.vocab_size == llm.engine.vocab_size != engine.max_model_len
    assert engine.max_model_len == llm.engine.scheduler_config.max_model_len
    prompts = ["The capital of France is", [1, 504, 3458, 282]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for prompt in prompts:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        key = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
        expected = llm.generate([key], params, use_tqdm=False)[0].outputs[0].text
        assert r.json()["choices"][0]["text"] == expected


def test_streamed_choices_over_the_pipe_join_to_the_whole_response(served):
    """n = 2 seeded samples with log-probs: the streamed deltas, joined per choice, equal the
    whole response, and so do the usage counts."""
    server, _ = served
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 10, "n": 2,
            "temperature": 1.0, "seed": 5, "logprobs": 2, "ignore_eos": True}  # fmt: skip
    url = server.url + "/v1/completions"
    whole = httpx.post(url, json=body, timeout=60).json()
    texts, tokens, usage = {0: "", 1: ""}, {0: [], 1: []}, None
    stream = body | {"stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=60) as h, h.stream("POST", url, json=stream) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            usage = chunk.get("usage") or usage
            for c in chunk["choices"]:
                texts[c["index"]] += c["text"]
                tokens[c["index"]] += c["logprobs"]["tokens"] if c["logprobs"] else []
    for c in whole["choices"]:
        assert texts[c["index"]] == c["text"] and tokens[c["index"]] == c["logprobs"]["tokens"]
        assert len(tokens[c["index"]]) == 10
    assert usage == whole["usage"] and usage["completion_tokens"] == 20


def test_a_rejected_prompt_is_a_400_and_the_server_goes_on(served):
    server, _ = served
    bad = {"model": MODEL, "prompt": [10**9], "max_tokens": 2}
    r = httpx.post(server.url + "/v1/completions", json=bad, timeout=60)
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    good = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    assert httpx.post(server.url + "/v1/completions", json=good, timeout=60).status_code == 200


def test_disconnect_aborts_and_frees_kv_blocks(served):
    server, engine = served
    free_before = engine.stats["kv_blocks_free"]
    body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": 400, "stream": True,
            "ignore_eos": True}  # fmt: skip
    url = server.url + "/v1/completions"
    with httpx.Client(timeout=60) as h, h.stream("POST", url, json=body) as r:
        received = [line for _, line in zip(range(3), r.iter_lines(), strict=False)]
        assert len(received) == 3
        assert engine.stats["kv_blocks_free"] < free_before
    assert wait_for(lambda: engine.stats["kv_blocks_free"] == free_before, timeout=30)
    assert engine.stats["num_requests_running"] == 0


@pytest.mark.slow
def test_a_killed_engine_process_fails_its_stream_and_comes_back(served):
    """kill -9 of the engine process: the stream in flight ends with an error event and
    [DONE]; /health is 503 and /metrics shows the engine down, without its last gauges,
    until a new engine process runs; then completions work again."""
    server, engine = served
    dead = engine._process
    body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": 400, "stream": True,
            "ignore_eos": True}  # fmt: skip
    url = server.url + "/v1/completions"
    with httpx.Client(timeout=60) as h, h.stream("POST", url, json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        os.kill(dead.pid, signal.SIGKILL)
        events = [line for line in lines if line.startswith("data:")]
    error = json.loads(events[-2][len("data: ") :])["error"]
    assert "engine process exited (-9)" in error["message"] and events[-1] == "data: [DONE]"
    assert httpx.get(server.url + "/health").status_code == 503
    scraped = httpx.get(server.url + "/metrics").text
    assert "octavo_engine_up 0.0" in scraped and "octavo_num_requests_running" not in scraped
    assert "octavo_engine_restarts_total 0.0" in scraped
    assert wait_for(lambda: httpx.get(server.url + "/health").status_code == 200, timeout=60)
    assert engine._process is not dead and engine._process.is_alive()
    scraped = httpx.get(server.url + "/metrics").text
    assert "octavo_engine_up 1.0" in scraped and "octavo_engine_restarts_total 1.0" in scraped
    good = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    assert httpx.post(url, json=good, timeout=60).json()["usage"]["completion_tokens"] == 2


def test_a_failing_step_fails_only_its_requests(llm):
    """The step both engine loops run (step_engine), on this process's engine: the requests
    of a failed step are aborted and reported; the next step runs."""
    engine, failed = llm.engine, []
    request = engine.add_request("Hello", SamplingParams(max_tokens=4), "doomed")
    live = {"doomed": request}
    runner = engine.runner
    runner.execute_async = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected"))
    try:
        assert step_engine(engine, live, lambda ids, e: failed.append((ids, e))) == []
    finally:
        del runner.execute_async
    ((ids, error),) = failed
    assert ids == ["doomed"] and isinstance(error, EngineStepError)
    assert str(error) == "the engine failed on this request: injected"
    assert not live and not engine.has_unfinished_requests()


def test_pipe_messages_reach_the_waiting_requests():
    """The server side alone, over a real pipe: a step failure and the engine's death."""
    engine, far_end = _server_side_of_a_pipe()
    params = SamplingParams(max_tokens=2)

    async def scenario():
        engine.start()
        failing = asyncio.ensure_future(_collect(engine.generate([1], params, "a")))
        dying = asyncio.ensure_future(_collect(engine.generate([1], params, "b")))
        await asyncio.sleep(0.1)
        # the engine knows each request by its id and the number of the generate call
        assert [far_end.recv().request_id for _ in range(2)] == ["0#a", "1#b"]
        far_end.send(("fail", ["0#a"], "boom"))
        with pytest.raises(EngineStepError, match="boom"):
            await asyncio.wait_for(failing, 30)
        far_end.close()  # the engine process is gone
        with pytest.raises(RuntimeError, match="the engine process exited"):
            await asyncio.wait_for(dying, 30)
        assert not engine.is_running

    asyncio.run(scenario())


def test_an_unreadable_message_fails_the_waiting_requests():
    engine, far_end = _server_side_of_a_pipe()

    async def scenario():
        engine.start()
        waiting = asyncio.ensure_future(_collect(engine.generate([1], SamplingParams(), "a")))
        await asyncio.sleep(0.1)
        far_end.send_bytes(b"not a pickle")
        with pytest.raises(RuntimeError, match="reading the engine's pipe failed"):
            await asyncio.wait_for(waiting, 30)
        assert not engine.is_running
        with pytest.raises(RuntimeError, match="not running"):
            await _collect(engine.generate([1], SamplingParams(), "b"))

    asyncio.run(scenario())


def test_prompt_ids_cross_the_pipe_once_and_every_output_has_them():
    """The engine side leaves a request's prompt ids out after its first output; the server
    side puts them back, so every output the consumer sees has them."""
    first = RequestOutput("a", None, [5, 6, 7], [CompletionOutput(0, "x", [1])])
    later = RequestOutput("a", None, [5, 6, 7], [CompletionOutput(0, "y", [2])], finished=True)
    announced: set[str] = set()
    _prompt_ids_once([first], announced, live={"a": None})
    _prompt_ids_once([later], announced, live={})  # finished: it has left `live`
    assert first.prompt_token_ids == [5, 6, 7] and later.prompt_token_ids is None
    assert announced == set()

    engine, far_end = _server_side_of_a_pipe()
    params = SamplingParams(max_tokens=2, output_kind=RequestOutputKind.DELTA)

    async def scenario():
        engine.start()
        stream = engine.generate([5, 6, 7], params, "a")
        waiting = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.1)
        assert far_end.recv().request_id == "0#a"
        first.request_id = later.request_id = "0#a"
        far_end.send(("step", [first], {}))
        assert (await asyncio.wait_for(waiting, 30)).prompt_token_ids == [5, 6, 7]
        far_end.send(("step", [later], {}))
        out = await asyncio.wait_for(anext(stream), 30)
        assert out.prompt_token_ids == [5, 6, 7] and out.outputs[0].text == "y"
        with pytest.raises(StopAsyncIteration):  # the request is done: forgotten
            await anext(stream)
        assert engine._prompt_ids == {} and engine._streams == {}
        far_end.close()

    asyncio.run(scenario())


def test_a_late_output_of_an_aborted_request_never_reaches_its_ids_next_user():
    """An output already on its way when a request was aborted, its first (with prompt ids)
    included, is dropped if a new request uses the id meanwhile."""
    engine, far_end = _server_side_of_a_pipe()
    params = SamplingParams(max_tokens=2, output_kind=RequestOutputKind.DELTA)

    async def scenario():
        engine.start()
        old = engine.generate([1, 2], params, "x")
        waiting = asyncio.ensure_future(anext(old))
        assert (await asyncio.to_thread(far_end.recv)).request_id == "0#x"
        waiting.cancel()  # the consumer leaves: the request is aborted
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        new = engine.generate([3, 4], params, "x")
        waiting = asyncio.ensure_future(anext(new))
        assert (await asyncio.to_thread(far_end.recv)).request_ids == ["0#x"]
        assert (await asyncio.to_thread(far_end.recv)).request_id == "1#x"
        late = RequestOutput("0#x", None, [1, 2], [CompletionOutput(0, "old", [7])])
        fresh = RequestOutput("1#x", None, [3, 4], [CompletionOutput(0, "new", [8])])
        far_end.send(("step", [late], {}))
        far_end.send(("step", [fresh], {}))
        out = await asyncio.wait_for(waiting, 30)
        assert (out.request_id, out.prompt_token_ids, out.outputs[0].text) == ("x", [3, 4], "new")
        far_end.close()

    asyncio.run(scenario())


def test_a_command_the_pipe_cannot_take_fails_only_its_request():
    engine, far_end = _server_side_of_a_pipe()
    unpicklable = SamplingParams()
    unpicklable.stop = [lambda: None]  # set after validation: pickle refuses it

    async def scenario():
        engine.start()
        with pytest.raises(ValueError, match="cannot be sent to the engine process"):
            await asyncio.wait_for(_collect(engine.generate([1], unpicklable, "bad")), 30)
        good = asyncio.ensure_future(_collect(engine.generate([1], SamplingParams(), "good")))
        aborted = await asyncio.to_thread(far_end.recv)  # the writer thread goes on
        added = await asyncio.to_thread(far_end.recv)
        assert aborted.request_ids == ["0#bad"] and added.request_id == "1#good"
        far_end.close()
        with pytest.raises(RuntimeError, match="the engine process exited"):
            await asyncio.wait_for(good, 30)

    asyncio.run(scenario())


def test_a_long_prompt_does_not_block_the_event_loop():
    """The pipe's buffer holds far less than a 2M-token prompt: until the engine process
    reads it, only the writer thread waits; the event loop goes on."""
    engine, far_end = _server_side_of_a_pipe()
    prompt = list(range(2_000_000))
    ticks = []

    async def scenario():
        engine.start()
        asyncio.ensure_future(_collect(engine.generate(prompt, SamplingParams(), "long")))
        for _ in range(5):  # the loop runs while the command waits in the pipe
            await asyncio.sleep(0.01)
            ticks.append(True)
        command = await asyncio.to_thread(far_end.recv)  # the engine process reads it
        assert command.request_id == "0#long" and command.prompt == prompt
        far_end.close()

    thread = threading.Thread(target=asyncio.run, args=(scenario(),), daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive():  # blocked in a send on the event loop: unblock, then fail
        far_end.recv()
        pytest.fail("the event loop waited for the pipe")
    assert len(ticks) == 5


def _server_side_of_a_pipe() -> tuple[EngineProcess, multiprocessing.connection.Connection]:
    """An EngineProcess over a real pipe whose far end the test plays (no engine process)."""
    conn, far_end = multiprocessing.Pipe()
    alive = types.SimpleNamespace(is_alive=lambda: True, exitcode=None, join=lambda timeout: None)
    return EngineProcess(alive, conn, 64, 100, {}, tokenizer=None), far_end


async def _collect(stream):
    return [out async for out in stream]


@pytest.mark.slow  # starts a Python process that imports torch
def test_bad_options_raise_in_the_server_process():
    with pytest.raises(ValueError, match="load_format"):
        EngineProcess.start_process(load_format="pickle")


def test_serve_runs_the_engine_in_a_process_unless_told_otherwise(monkeypatch):
    from octavo.entrypoints import cli
    from octavo.entrypoints.openai import cli_serve
    from octavo.entrypoints.openai.lifecycle import Server

    spawned, started, served = [], [], []
    fake = types.SimpleNamespace(
        get_stats=dict, tokenizer=None, scheduler_config=types.SimpleNamespace(max_model_len=64)
    )
    # The process is started before the server's imports, then waited for.
    monkeypatch.setattr(
        cli_serve, "start_engine_process", lambda options: spawned.append(options) or "process"
    )
    monkeypatch.setattr(
        EngineProcess,
        "start_process",
        lambda process, **options: started.append((process, options)) or AsyncEngine(fake),
    )
    monkeypatch.setattr(Server, "run", lambda self: served.append(self.config.app))
    args = cli.build_parser().parse_args(["serve", "--max-num-seqs", "7"])
    assert args.func(args) == 0
    assert len(spawned) == 1 and spawned[0]["max_num_seqs"] == 7
    assert started == [("process", spawned[0])]
