"""The scheduler's readiness check (structured outputs' compiling grammars) and the
runner's "grammar complete" report, with the fake runner: no torch, no grammar library."""

from __future__ import annotations

from fake_engine import FakeRunner, Spec, make_scheduler

from inflight.config import SchedulerConfig
from inflight.core.interface import ModelRunnerOutput
from inflight.core.kv_cache_manager import KVCacheManager
from inflight.core.request import Request, RequestStatus
from inflight.core.scheduler import Scheduler


class HeldBack:
    def __init__(self, *request_ids: str) -> None:
        self.held = set(request_ids)

    def is_ready(self, request: Request) -> bool:
        return request.request_id not in self.held


def scheduler_with(readiness: HeldBack) -> Scheduler:
    return Scheduler(SchedulerConfig(), KVCacheManager(64, 16, False), readiness=readiness)


def test_a_request_not_ready_waits_while_the_others_run() -> None:
    readiness = HeldBack("a")
    scheduler = scheduler_with(readiness)
    for request_id in ("a", "b"):
        scheduler.add_request(Spec(request_id, (5, 6, 7), max_tokens=4).make())
    runner = FakeRunner()
    for _ in range(2):  # b runs two steps; a stays waiting with no blocks
        out = scheduler.schedule()
        assert [s.request_id for s in out.scheduled] == ["b"]
        scheduler.update_from_output(out, runner.execute(out))
        scheduler.check_invariants()
    assert [r.request_id for r in scheduler.waiting] == ["a"]
    readiness.held.clear()
    out = scheduler.schedule()
    assert {s.request_id for s in out.scheduled} == {"a", "b"}
    scheduler.check_invariants()


def test_a_complete_grammar_finishes_the_request_with_stop() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(Spec("a", (5, 6, 7), max_tokens=10).make())
    scheduler.add_request(Spec("b", (5, 6, 7), max_tokens=10).make())
    out = scheduler.schedule()
    updates = scheduler.update_from_output(out, ModelRunnerOutput(
        sampled_token_ids={"a": 11, "b": 12}, grammar_finished_request_ids={"a"},
    ))
    by_id = {u.request_id: u for u in updates}
    assert by_id["a"].finished and by_id["a"].finish_reason == "stop"
    assert by_id["a"].stop_reason is None and by_id["a"].new_token_ids == [11]
    assert not by_id["b"].finished
    assert scheduler.requests["b"].status is RequestStatus.RUNNING
    scheduler.check_invariants()
