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
    """Where an EOS could not end the request (no EOS id, ignore_eos, min_tokens unmet),
    the grammar's end is the request's end."""
    scheduler = make_scheduler()
    scheduler.add_request(Spec("a", (5, 6, 7), max_tokens=10).make())
    scheduler.add_request(Spec("b", (5, 6, 7), max_tokens=10).make())
    scheduler.add_request(Spec("c", (5, 6, 7), max_tokens=10, eos=(2,), ignore_eos=True).make())
    scheduler.add_request(Spec("d", (5, 6, 7), max_tokens=10, eos=(2,), min_tokens=3).make())
    out = scheduler.schedule()
    updates = scheduler.update_from_output(out, ModelRunnerOutput(
        sampled_token_ids={"a": 11, "b": 12, "c": 13, "d": 14},
        grammar_finished_request_ids={"a", "c", "d"},
    ))
    by_id = {u.request_id: u for u in updates}
    for request_id in ("a", "c", "d"):
        assert by_id[request_id].finished and by_id[request_id].finish_reason == "stop"
        assert by_id[request_id].stop_reason is None
    assert by_id["a"].new_token_ids == [11]
    assert not by_id["b"].finished
    assert scheduler.requests["b"].status is RequestStatus.RUNNING
    scheduler.check_invariants()


def test_a_complete_grammar_goes_on_to_sample_the_eos_it_forces() -> None:
    """As vLLM: a finished grammar allows only EOS, which the next step samples and which
    ends the request as any EOS does (the last output token, counted in the usage)."""
    scheduler = make_scheduler()
    request = Spec("a", (5, 6, 7), max_tokens=10, eos=(2,)).make()
    scheduler.add_request(request)
    out = scheduler.schedule()
    update, = scheduler.update_from_output(out, ModelRunnerOutput(
        sampled_token_ids={"a": 11}, grammar_finished_request_ids={"a"},
    ))
    assert not update.finished
    out = scheduler.schedule()
    update, = scheduler.update_from_output(out, ModelRunnerOutput(
        sampled_token_ids={"a": 2}, grammar_finished_request_ids={"a"},
    ))
    assert update.finished and update.finish_reason == "stop" and update.stop_reason is None
    assert request.output_token_ids == [11, 2]
    scheduler.check_invariants()


def test_a_grammar_complete_at_max_tokens_ends_with_length() -> None:
    """The EOS is not sampled yet when max_tokens runs out: "length", as in vLLM."""
    scheduler = make_scheduler()
    scheduler.add_request(Spec("a", (5, 6, 7), max_tokens=1, eos=(2,)).make())
    out = scheduler.schedule()
    update, = scheduler.update_from_output(out, ModelRunnerOutput(
        sampled_token_ids={"a": 11}, grammar_finished_request_ids={"a"},
    ))
    assert update.finished and update.finish_reason == "length"
