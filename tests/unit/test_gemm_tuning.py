"""The start-up GEMM tuning's choice and the projections' dispatch (runner/gemm_tuning.py,
model/layers.py), without a GPU: timings are given, graph capture is simulated."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from octavo.model import layers
from octavo.model.layers import Linear
from octavo.runner.gemm_tuning import TuningCache, choose, tune_linears


def test_choose_takes_the_fastest_only_past_the_margin():
    assert choose(10.0, [9.0, 6.0, 7.0]) == 1
    assert choose(10.0, [9.8, 9.9]) is None  # 2% faster: within the 3% margin
    assert choose(10.0, [9.6]) == 0
    assert choose(10.0, [11.0, 12.0]) is None
    assert choose(10.0, []) is None
    assert choose(10.0, [9.0], margin=0.2) is None


def _linear() -> Linear:
    layer = Linear(8, 4)
    torch.nn.init.normal_(layer.weight)
    return layer


def test_a_tuned_projection_runs_its_gemm_only_while_capturing(monkeypatch):
    layer = _linear()
    calls = []

    def tuned(x, w):
        calls.append(x.shape[0])
        return torch.zeros(x.shape[0], w.shape[0])

    layer.tuned = {2: tuned}
    x = torch.randn(2, 8)
    assert torch.equal(layer(x), F.linear(x, layer.weight))  # not capturing: F.linear
    monkeypatch.setattr(layers, "_capturing", lambda x: True)
    assert torch.equal(layer(x), torch.zeros(2, 4)) and calls == [2]
    y = torch.randn(3, 8)
    assert torch.equal(layer(y), F.linear(y, layer.weight))  # no GEMM tuned at 3 rows
    strided = torch.randn(2, 16)[:, ::2]
    assert torch.equal(layer(strided), F.linear(strided, layer.weight))  # not contiguous
    assert calls == [2]
    layer.tuned = {2: lambda x, w: None}  # the GEMM cannot take this input
    assert torch.equal(layer(x), F.linear(x, layer.weight))


def test_nothing_is_tuned_on_the_cpu():
    model = torch.nn.Sequential(_linear(), _linear())
    assert tune_linears(model, [1, 2, 4]) == {}
    assert all(layer.tuned is None for layer in model)


def test_the_tuning_cache_round_trips_and_ignores_a_torn_file(tmp_path):
    path = str(tmp_path / "gemm_tuning" / "gpu.json")
    cache = TuningCache(path)
    assert cache.get("1024x2048/bfloat16/1") is None
    cache.put("1024x2048/bfloat16/1", {"algo": "00ff", "speedup": 2.17})
    cache.put("4096x1024/bfloat16/8", {"algo": None, "speedup": 1.0})
    cache.save()
    again = TuningCache(path)
    assert again.get("1024x2048/bfloat16/1") == {"algo": "00ff", "speedup": 2.17}
    assert again.get("4096x1024/bfloat16/8") == {"algo": None, "speedup": 1.0}
    with open(path, "w") as f:
        f.write('{"1024x2048/bfl')  # a write cut short
    assert TuningCache(path).entries == {}
    memory_only = TuningCache(None)
    memory_only.put("k", {"algo": None, "speedup": 1.0})
    memory_only.save()  # nowhere to write: no error
    assert list(tmp_path.glob("gemm_tuning/.saving-*")) == []
