"""A step's SchedulerOutput is plain data: it pickles without any Request, KV cache manager or
block, and its lists are copies, so a runner in another process sees exactly what one in this
process would."""

from __future__ import annotations

import io
import pickle

from octavo.config import SchedulerConfig
from octavo.core.kv_cache_manager import KVCacheManager
from octavo.core.request import Request
from octavo.core.sched_output import NewRequestData, ScheduledRequest, SchedulerOutput
from octavo.core.scheduler import Scheduler
from octavo.sampling_params import SamplingParams


class _Classes(pickle.Unpickler):
    """Unpickles while recording the module of every class the pickle names."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.found: set[str] = set()

    def find_class(self, module: str, name: str):
        self.found.add(f"{module}.{name}")
        return super().find_class(module, name)


def _scheduler() -> Scheduler:
    kv = KVCacheManager(32, 4, enable_prefix_caching=True)
    return Scheduler(SchedulerConfig(8, 64, 64), kv, eos_token_ids=[0])


def _update(s: Scheduler, so: SchedulerOutput, token: int) -> None:
    updated = s.update(so, {x.request_id: [token] * 2 for x in so.scheduled if x.sample})
    for request, status in zip(updated, s.stops.check_tokens(updated), strict=True):
        if status is not None:
            s.finish_request(request.request_id, status)


def test_a_pickled_step_holds_no_request_nor_kv_manager_state():
    s = _scheduler()
    s.add_request(Request("a", list(range(1, 10)), SamplingParams(max_tokens=8)))
    s.add_request(
        Request("b", list(range(1, 6)), SamplingParams(max_tokens=8, n=2, presence_penalty=1))
    )
    steps = []
    for token in (5, 6, 7):
        so = s.schedule()
        steps.append(so)
        _update(s, so, token)
    for so in steps:
        unpickler = _Classes(pickle.dumps(so))
        copy = unpickler.load()
        octavo_classes = {c for c in unpickler.found if c.startswith("octavo.")}
        assert octavo_classes <= {
            "octavo.core.sched_output.SchedulerOutput",
            "octavo.core.sched_output.NewRequestData",
            "octavo.core.sched_output.ScheduledRequest",
            "octavo.sampling_params.SamplingParams",
            "octavo.sampling_params.RequestOutputKind",
        }, octavo_classes
        assert [x.request_id for x in copy.scheduled] == [x.request_id for x in so.scheduled]
    first, second, third = steps
    # First step: both requests are new to the runner, with their whole block tables.
    assert [n.request_id for n in first.new_requests] == ["a", "b"]
    assert all(isinstance(n, NewRequestData) for n in first.new_requests)
    # Second step: b forked into b and b#1 at its first token; b comes anew with its n = 1
    # params, b#1 is new, a sends only what changed.
    assert [n.request_id for n in second.new_requests] == ["b", "b#1"]
    assert [n.sampling_params.n for n in second.new_requests] == [1, 1]
    assert [n.output_token_ids for n in second.new_requests] == [[5], [5]]
    item_a = next(x for x in second.scheduled if x.request_id == "a")
    assert isinstance(item_a, ScheduledRequest) and item_a.block_ids_start == 3
    # Third step: b reads its outputs (a penalty), so it gets its new token, 6.
    item_b = next(x for x in third.scheduled if x.request_id == "b")
    assert third.new_requests == [] and item_b.new_output_token_ids == [6]


def test_block_ids_in_a_step_are_copies_of_the_managers_tables():
    s = _scheduler()
    s.add_request(Request("a", list(range(1, 10)), SamplingParams(max_tokens=8)))
    so = s.schedule()
    sent = so.scheduled[0].new_block_ids
    assert sent == s.kv.get_block_ids("a") and sent is not s.kv.get_block_ids("a")
