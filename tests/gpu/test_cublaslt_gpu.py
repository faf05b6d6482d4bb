"""cuBLASLt through ctypes (kernels/cublaslt.py) and the start-up GEMM tuning that uses it
(runner/gemm_tuning.py): every candidate algorithm computes F.linear's product, eagerly and
replayed from a CUDA graph over new inputs, and a tuned projection gives that product inside
a graph."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from octavo.kernels import cublaslt
from octavo.model.layers import Linear
from octavo.runner import gemm_tuning

pytestmark = pytest.mark.gpu


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 1024, 2048), (7, 4096, 1024), (48, 1024, 3072),
                                           (64, 6144, 1024), (3, 512, 4096)])  # fmt: skip
def test_every_candidate_computes_the_product(m, n, k, dtype):
    g = torch.Generator(device="cuda").manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g, device="cuda", dtype=dtype)
    w = torch.randn(n, k, generator=g, device="cuda", dtype=dtype) / k**0.5
    ref = x.double() @ w.double().T
    gemm = cublaslt.LtGemm(m, n, k, dtype)
    algos = gemm.candidates(8)
    assert algos, "cuBLASLt offered no algorithm"
    torch_err = _rel_err(F.linear(x, w), ref)
    for algo in algos:
        assert _rel_err(gemm(x, w, algo), ref) < max(4 * torch_err, 4e-3)


def test_a_captured_call_reads_its_inputs_at_replay_and_outlives_its_descriptors():
    m, n, k = 8, 2048, 1024
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    gemm = cublaslt.LtGemm(m, n, k, torch.bfloat16)
    algo = gemm.candidates(4)[-1]  # a split-K variant where one exists
    gemm(x, w, algo)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemm(x, w, algo)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel_err(y, F.linear(x, w)) < 1e-2
    # Its descriptors go with the object, and the graph does not need them.
    release = gemm.release
    del gemm
    gc.collect()
    assert not release.alive
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert _rel_err(y, F.linear(x, w)) < 1e-2


def _two_projections() -> torch.nn.Module:
    """Two projections of one shape, o_proj-like (F.linear's cuBLAS pick is slow at one row
    on an H200)."""
    model = torch.nn.Sequential(Linear(2048, 1024), Linear(2048, 1024)).cuda().bfloat16()
    for layer in model:
        torch.nn.init.normal_(layer.weight, std=2048**-0.5)
    return model


def test_tuned_projections_run_the_winner_inside_graphs_only(monkeypatch, tmp_path):
    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(tmp_path))  # forced choices stay here
    model = _two_projections()
    monkeypatch.setattr(gemm_tuning, "MARGIN", -1.0)  # take the fastest candidate, whatever
    chosen = gemm_tuning.tune_linears(model, [1, 4, 128])
    assert set(chosen) == {"1024x2048/bfloat16/1", "1024x2048/bfloat16/4"}  # 128 > MAX_ROWS
    assert model[0].tuned is model[1].tuned and set(model[0].tuned) == {1, 4}

    calls = []
    tuned = model[0].tuned[4]
    monkeypatch.setitem(model[0].tuned, 4, lambda x, w: calls.append(1) or tuned(x, w))
    x = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
    eager = model[0](x)
    assert not calls  # eagerly: F.linear
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = model[0](x)
    assert calls == [1]
    graph.replay()
    torch.cuda.synchronize()
    assert _rel_err(captured, eager) < 1e-2


def test_a_second_start_up_takes_the_choices_from_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gemm_tuning, "MARGIN", -1.0)
    first = gemm_tuning.tune_linears(_two_projections(), [1, 2])
    assert set(first) == {"1024x2048/bfloat16/1", "1024x2048/bfloat16/2"}
    assert len(list(tmp_path.glob("gemm_tuning/*.json"))) == 1

    def no_timing(*args):
        raise AssertionError("timed again despite the cache")

    monkeypatch.setattr(gemm_tuning, "_measure", no_timing)
    model = _two_projections()
    assert gemm_tuning.tune_linears(model, [1, 2]) == first
    x = torch.randn(2, 2048, device="cuda", dtype=torch.bfloat16)
    assert _rel_err(model[0].tuned[2](x, model[0].weight), F.linear(x, model[0].weight)) < 1e-2


def test_a_stale_cache_entry_is_measured_again(monkeypatch, tmp_path):
    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gemm_tuning, "MARGIN", -1.0)
    cache = gemm_tuning.TuningCache.for_this_gpu()
    bogus = {"algo": "00" * 64, "speedup": 9.0}  # no algorithm cuBLASLt would accept
    cache.put("1024x2048/bfloat16/1", bogus)
    cache.put("1024x2048/bfloat16/2", {"algo": "zz", "speedup": 9.0})  # torn
    cache.save()
    chosen = gemm_tuning.tune_linears(_two_projections(), [1, 2])
    assert set(chosen) == {"1024x2048/bfloat16/1", "1024x2048/bfloat16/2"}
    assert 9.0 not in chosen.values()
    again = gemm_tuning.TuningCache.for_this_gpu()
    assert again.get("1024x2048/bfloat16/1") != bogus
