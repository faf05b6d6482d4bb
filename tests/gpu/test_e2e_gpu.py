"""On the GPU, with the same dummy Qwen3-0.6B weights: the Triton backend's greedy tokens
equal the torch backend's except at near ties, and its log-probs match HF transformers'
within bf16 tolerance, i.e. no further from HF's float32 log-probs than HF's own bf16 run is.
Run through the device tool; skipped without CUDA."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

NUM_PROMPTS, NUM_TOKENS = 16, 32
# A logit gap of at most two bf16 ulps counts as a tie: the logits come out of a bf16 lm_head,
# and at the magnitudes of these dummy weights' top logits (16 to 32) one ulp is 0.125.
NEAR_TIE = 0.25
# Weight scales: HF's 0.02 in the layers keeps the residual stream tame; a larger (tied)
# embedding / lm_head spreads the logits (std ~6) so that most greedy choices are clear.
LAYER_STD, EMBEDDING_STD = 0.02, 0.2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Dummy Qwen3-0.6B weights saved once as an HF directory, shared by all engines."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from octavo.engine.builder import resolve_model

    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained(resolve_model("qwen3-0.6b"))
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, EMBEDDING_STD if "embed" in name else LAYER_STD)
    path = tmp_path_factory.mktemp("qwen3-dummy")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [
        [rng.randint(0, 10000) for _ in range(rng.randint(20, 300))] for _ in range(NUM_PROMPTS)
    ]


def run(model_dir, prompts, backend, **options):
    from octavo import LLM, SamplingParams

    llm = LLM(model_dir, attention_backend=backend, max_model_len=1024, **options)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    del llm
    torch.cuda.empty_cache()
    return [o.outputs[0] for o in outs]


def assert_same_except_near_ties(outs, reference_outs) -> None:
    """Greedy tokens equal the reference's up to the first difference in each sequence,
    which must be a near tie under the reference's log-probs."""
    compared = 0
    for a, b in zip(outs, reference_outs, strict=True):
        for pos, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
            if ta != tb:
                alternative = b.logprobs[pos].get(ta)
                assert alternative is not None, f"diverged at {pos}: {ta} not in the top 5"
                gap = b.logprobs[pos][tb].logprob - alternative.logprob
                assert gap <= NEAR_TIE, f"diverged at {pos} with gap {gap}"
                break  # after a tie the sequences legitimately differ
            compared += 1
    assert compared > len(outs) * NUM_TOKENS // 2


def test_triton_greedy_tokens_match_torch_backend_except_near_ties(model_dir, prompts):
    triton_outs = run(model_dir, prompts, "triton")
    torch_outs = run(model_dir, prompts, "torch", enforce_eager=True)
    assert_same_except_near_ties(triton_outs, torch_outs)


def test_mixed_step_graphs_give_the_eager_tokens(model_dir, prompts, monkeypatch):
    """With 256 tokens a step, prompts go in chunks beside decode rows; those mixed steps
    replay as CUDA graphs, padded, and give the tokens of the same steps run eagerly
    (cuda_graph_max_tokens=0) except at near ties. Two prompts repeat an earlier one's
    start, so some chunks extend a cached prefix."""
    from octavo.runner.cuda_graph import CudaGraphRunner

    replayed = []
    real_replay = CudaGraphRunner.replay

    def spy(self, shape):
        replayed.append(shape)
        return real_replay(self, shape)

    monkeypatch.setattr(CudaGraphRunner, "replay", spy)
    rng = random.Random(1)
    extended = prompts + [p[:64] + [rng.randint(0, 10000) for _ in range(40)] for p in prompts[:2]]
    graphs = run(model_dir, extended, "triton", max_num_batched_tokens=256)
    mixed = [s for s in replayed if not s.decode]
    assert mixed, "no mixed step was replayed as a graph"
    eager = run(model_dir, extended, "triton", max_num_batched_tokens=256, cuda_graph_max_tokens=0)
    assert_same_except_near_ties(graphs, eager)


def test_an_fp8_kv_cache_holds_twice_the_blocks_and_gives_the_torch_backends_tokens(
    model_dir, prompts
):
    """kv_cache_dtype="fp8": the same kv_cache_memory holds twice bf16's blocks, and the
    Triton kernels in CUDA graphs give the torch backend's greedy tokens over an e4m3 cache,
    except at near ties."""
    from octavo import LLM

    blocks = {}
    for kv_cache_dtype, stored in (("auto", "bfloat16"), ("fp8", "float8_e4m3fn")):
        llm = LLM(model_dir, max_model_len=1024, kv_cache_memory=1 << 30, enforce_eager=True,
                  kv_cache_dtype=kv_cache_dtype)  # fmt: skip
        stats = llm.get_stats()
        assert stats["kv_cache_dtype"] == stored
        blocks[stored] = stats["kv_blocks_total"]
        del llm
    assert blocks["float8_e4m3fn"] // 2 == blocks["bfloat16"]
    triton_outs = run(model_dir, prompts, "triton", kv_cache_dtype="fp8")
    torch_outs = run(model_dir, prompts, "torch", enforce_eager=True, kv_cache_dtype="fp8")
    assert_same_except_near_ties(triton_outs, torch_outs)


def hf_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens)] log-probs of `tokens` after `prompt` under an HF model (float32 math on
    its output logits)."""
    ids = torch.tensor([prompt + tokens], device="cuda")
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, ids[0, len(prompt) :, None])[:, 0].cpu()


def test_triton_logprobs_match_hf(model_dir, prompts):
    assert_logprobs_match_hf(model_dir, prompts, run(model_dir, prompts, "triton"))


def assert_logprobs_match_hf(model_dir, prompts, outs) -> None:
    """The sampled tokens' log-probs are within bf16 tolerance of HF's float32 ones: at most
    twice HF's own bf16 error (plus a floor for tiny errors)."""
    from transformers import AutoModelForCausalLM

    hf = {
        dtype: AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
        for dtype in (torch.bfloat16, torch.float32)
    }
    ours_err = hf_bf16_err = 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        ref = hf_logprobs(hf[torch.float32], prompt, out.token_ids)
        hf_bf16 = hf_logprobs(hf[torch.bfloat16], prompt, out.token_ids)
        ours = torch.tensor(
            [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs, strict=True)]
        )
        ours_err = max(ours_err, (ours - ref).abs().max().item())
        hf_bf16_err = max(hf_bf16_err, (hf_bf16 - ref).abs().max().item())
    assert ours_err <= 2 * hf_bf16_err + 0.02, (ours_err, hf_bf16_err)


def test_async_scheduling_gives_the_synchronous_tokens(model_dir, prompts):
    """Overlapping the host with the device (the CUDA default) changes no token: the same
    kernels see the same batches, only the host's order of work differs."""
    overlapped = run(model_dir, prompts, "triton")
    serial = run(model_dir, prompts, "triton", async_scheduling=False)
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in serial]


def test_warm_up_samples_every_batch_size_and_leaves_the_random_stream(model_dir, monkeypatch):
    """Engine start-up runs the LM head and sampler at every batch size a decode step can
    have (so no kernel is loaded lazily mid-run), greedy and mixed, without drawing from the
    engine's own sampler: seeded-by-engine random tokens stay what they were."""
    import random as stdlib_random

    from octavo import LLM
    from octavo.runner.sampler import Sampler

    seen: list[tuple[int, bool]] = []
    real_call = Sampler.__call__

    def spy(self, logits, md):
        seen.append((logits.shape[0], md.all_greedy))
        return real_call(self, logits, md)

    monkeypatch.setattr(Sampler, "__call__", spy)
    llm = LLM(model_dir, max_model_len=1024, max_num_seqs=24, seed=7)
    sizes = range(1, 25)
    assert sorted(b for b, greedy in seen if greedy) == list(sizes)
    assert sorted(b for b, greedy in seen if not greedy) == list(sizes)
    engine_rng = llm.engine.runner.sampler._host_rng
    assert engine_rng.getstate() == stdlib_random.Random(7).getstate()
    del llm
    torch.cuda.empty_cache()


def test_prompt_logprobs_match_hf_in_chunks_and_graphs(model_dir, prompts):
    """prompt_logprobs on the GPU: prompts prefilled in 256-token chunks beside decode rows
    (mixed steps replayed as CUDA graphs) score their tokens as HF does, within bf16
    tolerance."""
    from transformers import AutoModelForCausalLM

    from octavo import LLM, SamplingParams

    llm = LLM(model_dir, attention_backend="triton", max_model_len=1024, max_num_batched_tokens=256)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    del llm
    torch.cuda.empty_cache()
    hf = {
        dtype: AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
        for dtype in (torch.bfloat16, torch.float32)
    }
    ours_err = hf_bf16_err = 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        ref = hf_logprobs(hf[torch.float32], prompt[:1], prompt[1:])
        hf_bf16 = hf_logprobs(hf[torch.bfloat16], prompt[:1], prompt[1:])
        ours = torch.tensor(
            [entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)]
        )
        ours_err = max(ours_err, (ours - ref).abs().max().item())
        hf_bf16_err = max(hf_bf16_err, (hf_bf16 - ref).abs().max().item())
    assert ours_err <= 2 * hf_bf16_err + 0.02, (ours_err, hf_bf16_err)
