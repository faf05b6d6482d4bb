"""Full and sliding-window layers in one model (Gemma 2 and 3): each kind keeps its own block
tables, and the sliding layers give back the blocks before their window during a request."""

from __future__ import annotations

import pytest
import torch
from model_utils import TINY, hf_greedy, random_hf_model
from transformers import Gemma3TextConfig

from octavo.core.hybrid_kv import HybridKVCacheManager, sliding_pool_blocks
from octavo.core.request import Request
from octavo.sampling_params import SamplingParams

WINDOW, SIZE = 8, 4


def _request(rid: str, token_ids: list[int]) -> Request:
    return Request(rid, token_ids, SamplingParams())


def _admit(kv: HybridKVCacheManager, request: Request) -> int:
    hits, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, hits)
    request.num_computed_tokens = request.num_tokens
    return num_hit


def _decode(kv: HybridKVCacheManager, request: Request, steps: int) -> list[int]:
    """Decodes `steps` tokens; the sliding blocks the request holds after each step."""
    held = []
    for _ in range(steps):
        request.append_output_token(7)
        assert kv.allocate_slots(request, 1)
        request.num_computed_tokens += 1
        held.append(sum(b is not None for b in kv.sliding._block_tables[request.request_id]))
    return held


def test_a_request_of_eight_windows_holds_window_over_block_size_plus_two_sliding_blocks():
    kv = HybridKVCacheManager(64, 64, SIZE, True, WINDOW)
    a = _request("a", list(range(10)))
    _admit(kv, a)
    held = _decode(kv, a, 8 * WINDOW - 10)
    assert max(held) <= WINDOW // SIZE + 2
    full = kv.full._block_tables["a"]
    assert None not in full and len(full) == 8 * WINDOW // SIZE
    assert kv.num_out_of_window == len(full) - held[-1] > 0
    # The runner gets both tables, index for index.
    assert len(kv.get_sliding_block_ids("a")) == len(kv.get_block_ids("a"))
    kv.free(a)
    assert kv.num_free_blocks == 64 and kv.sliding.num_free_blocks == 64
    assert kv.num_out_of_window == 0


def test_a_step_takes_blocks_from_both_pools_or_from_neither():
    kv = HybridKVCacheManager(64, 3, SIZE, True, WINDOW)
    a = _request("a", list(range(20)))  # 5 blocks: the sliding pool has 3
    hits, _ = kv.get_computed_blocks(a)
    assert not kv.allocate_slots(a, 20, hits)
    assert kv.num_free_blocks == 64 and "a" not in kv.full._block_tables
    assert kv.allocate_slots(a, 8, hits)  # a chunk that fits both
    assert kv.num_free_blocks == 62 and kv.sliding.num_free_blocks == 1


def test_a_prefix_hit_takes_the_whole_prefix_on_full_layers_and_its_window_on_sliding_ones():
    kv = HybridKVCacheManager(64, 64, SIZE, True, WINDOW)
    a = _request("a", list(range(40)))
    _admit(kv, a)
    _decode(kv, a, 6)
    kv.free(a)
    b = _request("b", list(range(40)) + [99])
    assert _admit(kv, b) == 40
    sliding = kv.sliding._block_tables["b"]
    # The next query (position 40) sees 33-40: blocks 8 and 9, and the one it writes.
    assert sliding[:8] == [None] * 8 and None not in sliding[8:]
    assert kv.num_out_of_window == 8 and kv.prefix_cache_hits == 40
    assert kv.get_sliding_block_ids("b")[:8] == [0] * 8  # stand-ins, read only masked


def test_a_prefix_hit_is_as_long_as_the_sliding_pool_still_holds_a_window():
    kv = HybridKVCacheManager(64, 64, SIZE, True, WINDOW)
    a = _request("a", list(range(40)))
    _admit(kv, a)
    kv.free(a)
    last = kv.sliding.pool.get_cached_block(a.block_hashes[9])
    kv.sliding.pool._evict(last)  # the sliding layers lost block 9, the full ones did not
    b = _request("b", list(range(40)) + [99])
    # 10 blocks would need 8 and 9; 9 blocks need 7 and 8, which are still there.
    assert kv.get_computed_blocks(b)[1] == 36
    kv.sliding.reset_prefix_cache()
    assert kv.get_computed_blocks(b)[1] == 0


def test_the_sliding_pool_is_sized_for_a_window_per_sequence_and_a_steps_tokens():
    assert sliding_pool_blocks(10_000, 512, 16, 256, 8192) == 256 * (32 + 2) + 512
    assert sliding_pool_blocks(100, 512, 16, 256, 8192) == 100  # never more than the full pool


# ---- a Gemma 3 model end to end ------------------------------------------------------------


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """A tiny Gemma 3 (sliding, sliding, sliding, full; window 8) saved as safetensors."""
    path = tmp_path_factory.mktemp("gemma3_hybrid")
    config = Gemma3TextConfig(
        **(TINY | {"num_hidden_layers": 4}), head_dim=24, query_pre_attn_scalar=32,
        sliding_window=WINDOW, layer_types=["sliding_attention"] * 3 + ["full_attention"],
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    hf = random_hf_model(config, seed=5)
    hf.save_pretrained(path)
    return hf, str(path)


def _llm(path: str, **options):
    from octavo import LLM

    options = {"num_kv_blocks": 64, "max_num_batched_tokens": 8, "max_num_seqs": 4} | options
    return LLM(path, device="cpu", quantization=None, block_size=SIZE, **options)


def test_gemma3_past_its_window_gives_hfs_tokens_and_gives_back_sliding_blocks(gemma3):
    """Prompts longer than the window in chunks of 8, decoded past it, a prefix hit, and two
    samples of one prompt (their blocks shared, then copied on write)."""
    hf, path = gemma3
    llm = _llm(path)
    stats = llm.get_stats()
    assert stats["kv_sliding_blocks_total"] == sliding_pool_blocks(64, WINDOW, SIZE, 4, 8) == 18
    prompts = [_prompt(11, 30), _prompt(12, 9)]
    greedy = SamplingParams(temperature=0, max_tokens=20, min_tokens=20)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    expected = [hf_greedy(hf, p, 20) for p in prompts]
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    again = llm.generate(
        {"prompt_token_ids": prompts[0]}, SamplingParams(temperature=0, max_tokens=20, n=2),
        use_tqdm=False,
    )  # fmt: skip
    assert [list(c.token_ids) for c in again[0].outputs] == [expected[0]] * 2
    stats = llm.get_stats()
    assert stats["prefix_cache_hits"] >= 24
    assert stats["kv_blocks_free"] == 64 and stats["kv_sliding_blocks_free"] == 18
    assert stats["kv_blocks_out_of_window"] == 0


def test_gemma3_preempted_for_blocks_gives_hfs_tokens(gemma3):
    """A full-layer pool too small for three requests at once: they take turns."""
    hf, path = gemma3
    llm = _llm(path, num_kv_blocks=16, enable_prefix_caching=False)
    prompts = [_prompt(20 + i, 18) for i in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(hf, p, 24) for p in prompts]
    assert llm.engine.scheduler.num_preemptions > 0


def test_a_draft_model_is_refused_for_a_target_with_two_kinds_of_layers(gemma3):
    _, path = gemma3
    draft = {"method": "draft_model", "model": path, "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="two ways"):
        _llm(path, speculative_config=draft)
