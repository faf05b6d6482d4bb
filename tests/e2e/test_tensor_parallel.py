"""Tensor parallelism on the CPU (gloo, float32): N ranks give N = 1's tokens and HF's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from model_utils import TINY, hf_greedy, random_hf_model
from transformers import LlamaConfig, Qwen3Config

from octavo import LLM, SamplingParams, StructuredOutputsParams
from octavo.config import ParallelConfig
from octavo.engine.builder import _check_parallel
from octavo.runner.multiproc import WorkerDied, free_port

CONFIGS = {
    # KV heads split over the ranks (2 each of 4 -> 1 each).
    "llama": lambda: LlamaConfig(**TINY, tie_word_embeddings=True),
    # One KV head that both ranks keep a copy of; untied head; per-head q/k norms.
    "qwen3": lambda: Qwen3Config(
        **(TINY | {"num_key_value_heads": 1}), head_dim=24, tie_word_embeddings=False
    ),
}
OPTIONS = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 64, "max_model_len": 256}
GREEDY = SamplingParams(max_tokens=10, min_tokens=10, temperature=0.0)


def _prompt(seed: int, length: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY["vocab_size"], (length,), generator=gen).tolist()


def _tiny_model(arch: str, path) -> torch.nn.Module:
    """An HF model of `arch` with random weights of a useful scale, saved to `path`."""
    hf = random_hf_model(CONFIGS[arch](), seed=1)
    hf.save_pretrained(path)
    return hf


def _tokens(llm: LLM, prompts: list[list[int]], params=GREEDY) -> list[list[list[int]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[list(c.token_ids) for c in out.outputs] for out in outs]


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory):
    """(path, HF model, N = 1 engine, N = 2 engine) of one tiny architecture."""
    path = tmp_path_factory.mktemp(request.param)
    hf = _tiny_model(request.param, path)
    one = LLM(str(path), **OPTIONS)
    two = LLM(str(path), tensor_parallel_size=2, **OPTIONS)
    yield str(path), hf, one, two
    two.shutdown()


def test_two_ranks_give_a_request_the_same_bits_in_any_batch(tiny):
    """Deterministic mode's promise at N = 2 on the CPU: the same tokens and log-probs alone
    and among others (the float32 kernels, and all-reduces that add one pair)."""
    two = tiny[3]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)
    target = _prompt(7, 23)

    def last(prompts: list[list[int]]):
        outs = two.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        c = outs[-1].outputs[0]
        return c.token_ids, [sorted((t, lp.logprob) for t, lp in d.items()) for d in c.logprobs]

    if not two.get_stats()["batch_invariant"]:  # qwen3's head_dim 24: torch's attention
        pytest.skip("attention in torch: the C kernel takes head_dim in multiples of 16")
    assert last([_prompt(i, 3 + 11 * i) for i in range(5)] + [target]) == last([target])


def test_two_ranks_give_one_ranks_greedy_tokens_and_hfs(tiny):
    _, hf, one, two = tiny
    prompts = [_prompt(i, 5 + 7 * i) for i in range(3)]
    expected = [[hf_greedy(hf, p, GREEDY.max_tokens)] for p in prompts]
    assert _tokens(one, prompts) == expected
    assert _tokens(two, prompts) == expected


def test_two_ranks_verify_speculative_guesses_as_one_rank_decodes(tiny):
    path, _, one, _ = tiny
    if "llama" not in path:
        pytest.skip("one architecture is enough")
    spec = LLM(path, tensor_parallel_size=2, speculative_config={"num_speculative_tokens": 3},
               **OPTIONS)  # fmt: skip
    try:
        prompts = [(_prompt(i, 6) * 4)[: 9 + 5 * i] for i in range(3)]  # repeats to look up
        params = SamplingParams(max_tokens=24, min_tokens=24, temperature=0.0, logprobs=1)
        assert _tokens(spec, prompts, params) == _tokens(one, prompts, params)
        stats = spec.get_stats()
        assert stats["spec_accepted_tokens"] > 0
    finally:
        spec.shutdown()


@pytest.mark.slow
def test_workers_profile_their_loop_on_request(tiny, tmp_path):
    """Each rank's cProfile stats of the steps between two calls, then its profiler trace."""
    import json
    import pstats

    _, _, _, two = tiny
    runner = two.engine.runner
    runner.profile()
    _tokens(two, [_prompt(3, 9)])
    paths = runner.profile(str(tmp_path / "stats"))
    assert len(paths) == 2
    for path in paths:
        assert any(fn == "execute_async" for _, _, fn in pstats.Stats(path).stats)
    runner.profile(trace=True)
    _tokens(two, [_prompt(4, 9)])
    with open(runner.profile(str(tmp_path / "trace"), trace=True)[1]) as f:
        assert json.load(f)["traceEvents"]


def test_two_ranks_sample_n_like_one_rank(tiny):
    _, _, one, two = tiny
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    prompts = [_prompt(10, 12), _prompt(11, 20)]
    assert _tokens(two, prompts, params) == _tokens(one, prompts, params)


def test_two_ranks_share_prefixes_like_one_rank(tiny):
    _, _, one, two = tiny
    prefix = _prompt(20, 48)
    prompts = [prefix + _prompt(21, 5), prefix + _prompt(22, 9)]
    hits = two.engine.get_stats()["prefix_cache_hits"]
    assert _tokens(two, prompts[:1]) == _tokens(one, prompts[:1])
    assert _tokens(two, prompts[1:]) == _tokens(one, prompts[1:])
    assert two.engine.get_stats()["prefix_cache_hits"] >= hits + 48


def test_two_ranks_answer_alike_after_giving_their_free_kv_memory_back(tiny):
    _, _, one, two = tiny
    prompts = [_prompt(23, 40)]
    first = _tokens(two, prompts)
    released = two.engine.release_kv_memory()  # each worker gives its free blocks' pages back
    assert released > 0 or not sys.platform.startswith("linux")
    hits = two.engine.get_stats()["prefix_cache_hits"]
    assert _tokens(two, prompts) == first == _tokens(one, prompts)
    assert two.engine.get_stats()["prefix_cache_hits"] == hits  # the cache was forgotten


def test_two_ranks_beam_search_like_one_rank(tiny):
    from octavo.engine.beam_search import BeamSearchParams

    _, _, one, two = tiny
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    prompts = [{"prompt_token_ids": _prompt(30, 10)}]
    seqs = [[b.tokens for b in llm.beam_search(prompts, params)[0].sequences] for llm in (one, two)]
    assert seqs[0] == seqs[1]


def _prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return torch.tensor(
        [
            o.prompt_logprobs[i][p[i]].logprob
            for o, p in zip(outs, prompts)
            for i in range(1, len(p))
        ]
    )


@pytest.mark.slow
@pytest.mark.parametrize("tiny", ["llama"], indirect=True)
@pytest.mark.parametrize(
    "quantized",
    [{"quantization": "int8"}, {"quantization": "fp8"}, {"kv_cache_dtype": "fp8"}],
    ids=["int8", "fp8", "kv-fp8"],
)
def test_two_ranks_quantize_their_shards(tiny, quantized):
    """Each rank quantizes its own shard (a row-parallel shard gets scales of its own), or
    stores its own heads' K/V in an fp8 cache, so N = 2 is not N = 1 bit for bit but as close
    to float32 as N = 1."""
    path, _, one, _ = tiny
    prompts = [_prompt(50 + i, 24) for i in range(3)]
    exact = _prompt_logprobs(one, prompts)
    one_q = LLM(path, **quantized, **OPTIONS)
    two_q = LLM(path, tensor_parallel_size=2, **quantized, **OPTIONS)
    try:
        err_one = (_prompt_logprobs(one_q, prompts) - exact).abs().mean().item()
        err_two = (_prompt_logprobs(two_q, prompts) - exact).abs().mean().item()
    finally:
        two_q.shutdown()
    assert 0 < err_two < max(2 * err_one, 1e-3), (err_one, err_two)


@pytest.mark.slow
def test_two_ranks_preempt_like_one_rank(tmp_path):
    _tiny_model("llama", tmp_path)
    options = OPTIONS | {"num_kv_blocks": 12, "block_size": 16, "max_model_len": 128}
    prompts = [_prompt(40 + i, 30) for i in range(6)]  # 6 x 3 blocks > 12: preemption
    params = SamplingParams(max_tokens=16, min_tokens=16, temperature=0.0)
    one = LLM(str(tmp_path), **options)
    two = LLM(str(tmp_path), tensor_parallel_size=2, **options)
    try:
        assert _tokens(two, prompts, params) == _tokens(one, prompts, params)
        assert two.engine.get_stats()["num_preemptions"] > 0
    finally:
        two.shutdown()


@pytest.mark.slow
def test_smollm2_with_three_ranks_gives_one_ranks_text(llm):
    """The embedded model's 9 heads and 3 KV heads over 3 ranks: one KV head each."""
    three = LLM(tensor_parallel_size=3, num_kv_blocks=64, max_model_len=512, quantization=None)
    try:
        prompts = ["The capital of France is", "def fibonacci(n):"]
        params = SamplingParams(max_tokens=12, temperature=0.0)
        texts = [[o.outputs[0].text for o in m.generate(prompts, params, use_tqdm=False)]
                 for m in (llm, three)]  # fmt: skip
        assert texts[1] == texts[0]
        # Structured outputs: their steps sample under a bitmask the workers receive after
        # the forward pass ("execute", then "sample"), also held behind a step in flight.
        regex = SamplingParams(
            max_tokens=12,
            temperature=0.0,
            structured_outputs=StructuredOutputsParams(regex="[a-z ]{6,20}"),
        )
        three.engine.async_scheduling = True
        mixed = [params, regex]
        texts = [[o.outputs[0].text for o in m.generate(prompts, mixed, use_tqdm=False)]
                 for m in (llm, three)]  # fmt: skip
        assert texts[1] == texts[0]
    finally:
        three.shutdown()


def test_sizes_that_do_not_split_the_model_are_refused_before_anything_starts(llm):
    cfg = llm.engine.runner.hf_config  # SmolLM2: 9 heads, 3 KV heads
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 .*9 attention heads"):
        _check_parallel(ParallelConfig(2), cfg, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"needs 3 GPUs on this node, but \d+ are visible"):
        if torch.cuda.device_count() >= 3:
            pytest.skip("this machine has the GPUs")
        _check_parallel(ParallelConfig(3), cfg, torch.device("cuda"))
    with pytest.raises(ValueError, match="nnodes=2 does not divide tensor_parallel_size=3"):
        ParallelConfig(3, nnodes=2, dist_init_addr="127.0.0.1:5000")
    with pytest.raises(ValueError, match="tensor_parallel_size=2 .*9 attention heads"):
        LLM(tensor_parallel_size=2)


@pytest.mark.slow
def test_a_killed_worker_fails_the_requests_and_stops_the_others(tmp_path):
    _tiny_model("llama", tmp_path)
    two = LLM(str(tmp_path), tensor_parallel_size=2, **OPTIONS)
    procs = list(two.engine.runner._procs)
    engine = two.engine
    for i in range(4):
        engine.add_request(_prompt(i, 20), GREEDY, f"r{i}")
    engine.step()
    os.kill(procs[1].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDied, match="rank 1"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < 30
    assert not engine.has_unfinished_requests()
    assert engine.get_stats()["kv_blocks_free"] == engine.get_stats()["kv_blocks_total"]
    assert all(proc.poll() is not None for proc in procs)  # no orphan
    with pytest.raises(WorkerDied):  # and no hang afterwards
        two.generate([{"prompt_token_ids": _prompt(9, 5)}], GREEDY, use_tqdm=False)


@pytest.mark.slow
@pytest.mark.parametrize("tiny", ["llama"], indirect=True)
def test_two_nodes_launched_as_separate_commands(tiny, tmp_path):
    """Node 1 runs only its worker (`octavo serve --node-rank 1`); node 0 runs the engine."""
    path, _, one, _ = tiny
    addr = f"127.0.0.1:{free_port()}"
    node1 = subprocess.Popen(
        [sys.executable, "-m", "octavo.entrypoints.cli", "serve", "--tensor-parallel-size", "2",
         "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr],
    )  # fmt: skip
    try:
        two = LLM(path, tensor_parallel_size=2, nnodes=2, dist_init_addr=addr, **OPTIONS)
        prompts = [_prompt(50, 9), _prompt(51, 17)]
        assert _tokens(two, prompts) == _tokens(one, prompts)
        two.shutdown()
        assert node1.wait(30) == 0
    finally:
        node1.kill()


@pytest.mark.slow
def test_a_served_engine_whose_worker_dies_fails_the_stream_and_comes_back(tmp_path):
    """`octavo serve` over two ranks: a killed worker ends the stream in flight with an
    error, /health is 503 until a new engine process with new workers runs, and no worker
    of the old one is left."""
    import httpx
    import psutil
    from server_fixture import ServerThread, wait_for

    from octavo.engine.engine_process import EngineProcess
    from octavo.entrypoints.openai.api_server import build_app

    _tiny_model("llama", tmp_path)
    engine = EngineProcess.start_process(model=str(tmp_path), tensor_parallel_size=2, **OPTIONS)
    with ServerThread(build_app(engine, "tiny")) as server:
        old = psutil.Process(engine._process.pid).children()
        assert len(old) == 2
        url = server.url + "/v1/completions"
        body = {"model": "tiny", "prompt": _prompt(60, 10), "max_tokens": 200, "stream": True,
                "ignore_eos": True}  # fmt: skip
        with httpx.Client(timeout=60) as h, h.stream("POST", url, json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            old[1].kill()
            events = [line for line in lines if line.startswith("data:")]
        assert '"error"' in events[-2] and events[-1] == "data: [DONE]"
        assert "the engine process died: tensor-parallel worker rank 1 died" in events[-2]
        assert "WorkerDied" not in events[-2]
        assert wait_for(lambda: httpx.get(server.url + "/health").status_code == 200, 60)
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in old)
        good = {"model": "tiny", "prompt": _prompt(61, 5), "max_tokens": 3}
        assert httpx.post(url, json=good, timeout=60).json()["usage"]["completion_tokens"] == 3


def _phi3():
    from transformers import Phi3Config

    return Phi3Config(**TINY, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _gemma3():
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **(TINY | {"num_hidden_layers": 2}), head_dim=16, query_pre_attn_scalar=24,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip


@pytest.mark.parametrize(
    "family,config",
    # Phi-3 stores q/k/v and gate/up fused: each rank takes its heads and columns of each.
    # Gemma 3: norms around both sub-blocks, q/k norms, per-kind rope bases, a window of 8.
    [("phi3", _phi3), ("gemma3", _gemma3)],
)
def test_two_ranks_run_each_family_as_hf(family, config, tmp_path):
    CONFIGS[family] = config
    try:
        hf = _tiny_model(family, tmp_path)
    finally:
        del CONFIGS[family]
    two = LLM(str(tmp_path), tensor_parallel_size=2, **OPTIONS)
    try:
        prompts = [_prompt(70 + i, 6 + 5 * i) for i in range(2)]
        expected = [[hf_greedy(hf, p, GREEDY.max_tokens)] for p in prompts]
        assert _tokens(two, prompts) == expected
    finally:
        two.shutdown()
