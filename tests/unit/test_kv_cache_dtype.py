"""kv_cache_dtype="fp8": e4m3 storage over a scale, the torch backend's attention over such a
cache against a float cache and against the float32 reference, the blocks a budget buys, and
the option from the commands down to its validation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from attention_reference import reference_attention
from model_utils import TINY
from test_torch_backend import _case

from octavo.attention.torch_backend import (
    FP8,
    TorchAttentionBackend,
    from_kv_cache,
    to_kv_cache,
)
from octavo.config import CacheConfig
from octavo.entrypoints import cli
from octavo.runner import kv_setup


def test_values_are_stored_over_their_scale_in_e4m3_and_clamped():
    x = torch.tensor([1.0, -3.0, 0.3, 1000.0, -1000.0])
    stored = to_kv_cache(x, FP8, 0.5)
    assert stored.dtype == FP8 and stored.element_size() == 1
    # 0.3 / 0.5 = 0.6 rounds to e4m3's 0.625; 2000 clamps to 448
    assert from_kv_cache(stored, torch.float32, 0.5).tolist() == [1.0, -3.0, 0.3125, 224, -224]
    assert torch.equal(to_kv_cache(x, torch.bfloat16, 0.5), x.bfloat16())  # no scale


@pytest.mark.parametrize(
    "query_lens,seq_lens",
    [([1] * 5, [3, 40, 17, 1, 64]), ([3, 8, 1, 4], [11, 8, 20, 13])],  # decode; mixed
)
def test_an_fp8_cache_attends_as_its_float_values_do(query_lens, seq_lens):
    """Over the same K/V, an fp8 cache (with scales) gives the float32 reference's output on
    its e4m3 values exactly, and the float cache's output within e4m3's rounding."""
    md, cache, (q, k, v) = _case(query_lens, seq_lens, heads=6, kv_heads=2)
    k_scale, v_scale = 0.02, 0.3
    fp8_cache = torch.cat(
        [to_kv_cache(cache[:1], FP8, k_scale), to_kv_cache(cache[1:], FP8, v_scale)]
    )
    backend = TorchAttentionBackend()
    out = backend.forward(q, k, v, fp8_cache, md, 0.25, k_scale, v_scale)
    float_out = backend.forward(q, k, v, cache, md, 0.25)
    ref = reference_attention(q, k, v, fp8_cache.clone(), md, 0.25, k_scale, v_scale)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert ((out - float_out).norm() / float_out.norm()).item() < 0.05
    slots = md.slot_mapping
    assert torch.equal(fp8_cache.view(2, -1, 2, 16)[1, slots], to_kv_cache(v, FP8, v_scale))


def test_the_same_budget_holds_twice_the_bfloat16_blocks():
    cfg = SimpleNamespace(**TINY)
    budget = CacheConfig(kv_cache_memory=10 * kv_setup.kv_bytes_per_block(cfg, 16, torch.bfloat16))
    counts = [
        kv_setup.num_kv_blocks(
            budget, kv_setup.kv_bytes_per_block(cfg, 16, dtype), torch.device("cpu"), lambda: 0
        )
        for dtype in (torch.bfloat16, torch.float8_e4m3fn)
    ]
    assert counts == [10, 20]


def test_names_and_bad_values():
    model_dtype, cpu = torch.bfloat16, torch.device("cpu")
    assert kv_setup.kv_cache_dtype("auto", model_dtype, cpu) == model_dtype
    for name in ("fp8", "fp8_e4m3"):
        assert kv_setup.kv_cache_dtype(name, model_dtype, cpu) == torch.float8_e4m3fn
    for bad in ("fp8_e5m2", "int8", "bfloat16", None):
        with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
            CacheConfig(cache_dtype=bad)


def test_fp8_needs_a_gpu_with_fp8(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' needs a GPU with FP8"):
        kv_setup.kv_cache_dtype("fp8", torch.bfloat16, cuda)
    assert kv_setup.kv_cache_dtype("auto", torch.bfloat16, cuda) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert kv_setup.kv_cache_dtype("fp8", torch.bfloat16, cuda) == torch.float8_e4m3fn


def test_build_engine_refuses_a_bad_value_before_loading():
    from octavo.engine.builder import build_engine

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        build_engine("qwen3-0.6b", load_format="dummy", kv_cache_dtype="fp16")


class _EngineOptions(Exception):
    """Raised in place of building an engine, with the options it would have been built with."""


@pytest.mark.parametrize(
    "command",
    [["generate", "hi"], ["chat"], ["serve"], ["bench", "throughput"]],
    ids=["generate", "chat", "serve", "bench-throughput"],
)
def test_every_command_passes_kv_cache_dtype_to_the_engine(monkeypatch, command):
    from octavo.engine.engine_process import EngineProcess
    from octavo.entrypoints import llm
    from octavo.entrypoints.openai import cli_serve

    def capture(*args, **options):
        raise _EngineOptions(options)

    monkeypatch.setattr(llm, "build_engine", capture)
    monkeypatch.setattr(cli_serve, "start_engine_process", lambda options: capture(**options))
    monkeypatch.setattr(EngineProcess, "start_process", capture)
    with pytest.raises(_EngineOptions) as built:
        cli.main([*command, "--kv-cache-dtype", "fp8"])
    assert built.value.args[0]["kv_cache_dtype"] == "fp8"
    with pytest.raises(SystemExit):  # argparse's choices
        cli.main([*command, "--kv-cache-dtype", "fp16"])
