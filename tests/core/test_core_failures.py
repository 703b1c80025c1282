"""A request whose part of a step failed ends alone ("error"); the others are unchanged.

The runner reports failed request ids in ``ModelRunnerOutput.failed_requests`` and the
scheduler finishes them in ``update_from_output``; the expected tokens of the others are
those of the same requests run alone (``reference_output``).
"""

from __future__ import annotations

from fake_engine import FakeRunner, Spec, assert_matches_reference, drive, make_scheduler

from inflight.core.interface import ModelRunnerOutput, SchedulerOutput

PROMPT = (5, 17, 301, 42, 7, 999)


class FailingRunner(FakeRunner):
    """Reports ``victim`` as failed from step ``at_step`` on, like a runner whose sampler
    state or inputs for that request could not be prepared."""

    def __init__(self, victim: str, at_step: int, block_size: int) -> None:
        super().__init__(block_size)
        self.victim = victim
        self.at_step = at_step

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        output = super().execute(scheduler_output)
        if scheduler_output.step_id < self.at_step:
            return output
        ids = {s.request_id for s in scheduler_output.scheduled}
        if self.victim not in ids:
            return output
        sampled = {k: v for k, v in output.sampled_token_ids.items() if k != self.victim}
        return ModelRunnerOutput(sampled, failed_requests={self.victim: "boom"})


def test_a_failed_request_ends_alone_with_error_and_frees_its_blocks() -> None:
    scheduler = make_scheduler(num_blocks=64, block_size=4)
    good = [Spec("a", PROMPT, max_tokens=8), Spec("c", PROMPT[:4], max_tokens=9)]
    bad = Spec("b", PROMPT[1:], max_tokens=8)
    runner = FailingRunner("b", at_step=3, block_size=4)
    result = drive(scheduler, runner, arrivals={0: [good[0].make(), bad.make(), good[1].make()]})
    assert result.finish_reasons["b"] == "error"
    assert result.stop_reasons["b"] is None
    assert len(result.outputs["b"]) == 3  # one token from each of steps 0, 1 and 2
    assert_matches_reference(result, good)
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks
    # The runner is told to drop the failed request's state next step.
    assert "b" in result.steps[4].output.finished_request_ids


def test_a_failure_in_a_prompt_chunk_that_does_not_sample_ends_the_request() -> None:
    scheduler = make_scheduler(
        num_blocks=64, block_size=4, max_num_batched_tokens=8, enable_chunked_prefill=True
    )
    good = Spec("a", PROMPT[:2], max_tokens=6)
    bad = Spec("b", tuple(range(100, 130)), max_tokens=4)
    runner = FailingRunner("b", at_step=1, block_size=4)
    result = drive(scheduler, runner, arrivals={0: [good.make(), bad.make()]})
    assert result.finish_reasons["b"] == "error" and result.outputs["b"] == []
    assert_matches_reference(result, [good])
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_the_error_update_carries_the_message() -> None:
    scheduler = make_scheduler()
    runner = FailingRunner("b", at_step=0, block_size=16)
    result = drive(scheduler, runner, arrivals={0: [Spec("b", PROMPT).make()]})
    (update,) = result.steps[0].updates
    assert (update.finished, update.finish_reason, update.error) == (True, "error", "boom")
