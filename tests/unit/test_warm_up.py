"""The start-up GEMM warm-up (`warm_up_rows`, `warm_up_linears` in octavo/runner/kv_setup.py)
on the CPU: which row counts it runs, and that it runs each distinct projection once per count
on contiguous inputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from octavo.model.layers import Linear, MergedLinear
from octavo.runner.kv_setup import warm_up_linears, warm_up_rows


@given(st.integers(1, 70000))
def test_rows_are_sorted_distinct_and_bounded(max_rows):
    rows = warm_up_rows(max_rows)
    assert rows == sorted(set(rows))
    assert rows[0] == 1 and rows[-1] == max_rows
    assert rows[: min(16, max_rows)] == list(range(1, min(16, max_rows) + 1))


@given(st.integers(64, 70000))
def test_rows_cover_every_doubling_aligned_and_odd(max_rows):
    rows = warm_up_rows(max_rows)
    low = 32
    while 2 * low <= max_rows:
        inside = [r for r in rows if low <= r < 2 * low]
        enough = min(6, low // 8)  # [32, 64) holds only 4 multiples of 8
        assert sum(r % 8 == 0 for r in inside) >= enough, (low, inside)
        assert sum(r % 2 == 1 for r in inside) >= enough, (low, inside)
        low *= 2


class Spy(Linear):
    """A Linear that records the shape and contiguity of every input it is given."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[tuple[int, ...], bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append((tuple(x.shape), x.is_contiguous()))
        return F.linear(x, self.weight, self.bias)


def test_each_distinct_projection_runs_once_per_row_count():
    model = nn.ModuleList(
        [
            Spy(8, 24),
            Spy(8, 24),  # same shape as the first: skipped
            Spy(8, 24, bias=True),  # a bias makes it another GEMM
            Spy(24, 8),
            nn.Linear(8, 8),  # not ours: left alone
        ]
    )
    for module in model:
        nn.init.normal_(module.weight)
    launched = warm_up_linears(model, 40)
    rows = warm_up_rows(40)
    assert launched == 3 * len(rows)
    assert [s for s, _ in model[0].calls] == [(r, 8) for r in rows]
    assert model[1].calls == []
    assert [s for s, _ in model[2].calls] == [(r, 8) for r in rows]
    assert [s for s, _ in model[3].calls] == [(r, 24) for r in rows]
    assert all(contiguous for m in (model[0], model[2], model[3]) for _, contiguous in m.calls)


def test_weights_of_two_dtypes_get_inputs_of_their_own():
    model = nn.ModuleList([Spy(8, 4), Spy(16, 4).double()])
    assert warm_up_linears(model, 9) == 2 * len(warm_up_rows(9))
    assert [s for s, _ in model[1].calls][-1] == (9, 16)


def test_fused_linears_count_by_their_full_weight():
    merged = MergedLinear(8, [16, 16])
    nn.init.normal_(merged.weight)
    assert warm_up_linears(nn.ModuleList([merged, Linear(16, 8)]), 5) == 2 * 5
    assert warm_up_linears(nn.Module(), 5) == 0
