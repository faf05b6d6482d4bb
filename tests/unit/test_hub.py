"""Models by hub id: a cache laid out as huggingface_hub lays it (built here) loads by id,
offline; a GGUF repo's file is picked by quantization or name; a model neither cached nor
reachable is one clear line naming the cache."""

from __future__ import annotations

import shutil

import pytest
import torch
from model_utils import TINY
from transformers import LlamaConfig, LlamaForCausalLM

from octavo import LLM, SamplingParams
from octavo.checkpoint.hub import download, looks_like_hub_id

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cache_repo(cache, repo: str, revision: str = "main"):
    """An empty snapshot of `repo` in the layout huggingface_hub keeps: refs/<rev> names a
    commit, snapshots/<commit>/ holds the files."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / revision).write_text(COMMIT)
    snapshot = root / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_a_cached_model_loads_by_its_id_offline(offline_cache, tmp_path):
    snapshot = _cache_repo(offline_cache, "tiny-org/tiny-llama")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(snapshot)
    llm = LLM("tiny-org/tiny-llama", device="cpu", num_kv_blocks=16, max_model_len=64)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3),
                       use_tqdm=False)  # fmt: skip
    assert len(out[0].outputs[0].token_ids) == 3


def test_a_gguf_file_is_picked_by_quantization_or_name(offline_cache, smollm2_path):
    snapshot = _cache_repo(offline_cache, "org/model-GGUF")
    for name in ("model-Q4_K_M.gguf", "model-Q8_0.gguf"):
        shutil.copy(smollm2_path, snapshot / name)
    assert download("org/model-GGUF:q8_0").endswith("model-Q8_0.gguf")
    assert download("org/model-GGUF/model-Q4_K_M.gguf").endswith("model-Q4_K_M.gguf")
    with pytest.raises(ValueError, match="matches several of"):
        download("org/model-GGUF")
    with pytest.raises(ValueError, match="names none of"):
        download("org/model-GGUF:IQ2_XS")


def test_an_uncached_model_offline_is_one_line_naming_the_cache(offline_cache):
    with pytest.raises(ValueError) as info:
        LLM("nobody/nothing", device="cpu")
    message = str(info.value)
    assert "\n" not in message and str(offline_cache) in message and "HF_HUB_OFFLINE" in message


def test_hub_ids_and_paths_are_told_apart(tmp_path):
    assert looks_like_hub_id("Qwen/Qwen3-0.6B")
    assert looks_like_hub_id("org/name:Q4_K_M") and looks_like_hub_id("org/n/f.gguf")
    assert not looks_like_hub_id(str(tmp_path))  # exists
    assert not looks_like_hub_id("model.gguf") and not looks_like_hub_id("a/b/c")
