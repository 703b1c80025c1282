"""long_prefill_token_threshold (vLLM's name): a long prompt takes at most the threshold
per step while another request runs or waits, so the requests behind it are not stuck
for a whole budget-filling step; alone, it takes the whole budget."""

from __future__ import annotations

import random

import pytest
from fake_engine import Spec, assert_matches_reference, make_scheduler, run_specs

from inflight.config import SchedulerConfig, make_engine_config
from inflight.core.prefill_cap import PrefillCap


def prompt(n: int, seed: int = 0) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(1, 5000) for _ in range(n))


def chunks(result, request_id: str) -> list[tuple[int, int]]:
    """(step, tokens) of every prompt chunk the request got."""
    return [
        (index, item.num_tokens)
        for index, step in enumerate(result.steps)
        for item in step.output.scheduled
        if item.request_id == request_id and item.is_prefill
    ]


def test_a_long_prompt_leaves_room_for_the_one_behind_it() -> None:
    specs = [Spec("long", prompt(100), max_tokens=3), Spec("short", prompt(10, 1), max_tokens=3)]
    capped = run_specs(
        make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=32), specs
    )
    # Step 0: 32 of the long prompt and the whole short one, in the same step.
    assert chunks(capped, "long")[0] == (0, 32)
    assert chunks(capped, "short") == [(0, 10)]
    assert [t for _, t in chunks(capped, "long")] == [32, 32, 32, 4]
    assert_matches_reference(capped, specs)

    # Without the cap the long prompt takes all 64 tokens and the short one waits a step.
    uncapped = run_specs(make_scheduler(max_num_batched_tokens=64), specs)
    assert chunks(uncapped, "long")[0] == (0, 64)
    assert chunks(uncapped, "short")[0][0] == 1
    assert_matches_reference(uncapped, specs)


def test_a_prompt_alone_takes_the_whole_budget() -> None:
    spec = Spec("long", prompt(100), max_tokens=2)
    result = run_specs(
        make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=16), [spec]
    )
    assert [t for _, t in chunks(result, "long")] == [64, 36]
    assert_matches_reference(result, [spec])


def test_two_long_prompts_share_steps_and_match_the_reference() -> None:
    specs = [Spec("a", prompt(90), max_tokens=4), Spec("b", prompt(70, 1), max_tokens=4)]
    result = run_specs(
        make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=24), specs
    )
    for step in result.steps:
        for item in step.output.scheduled:
            assert item.num_tokens <= 24 or len(step.running_before) + len(step.waiting_before) <= 1
    # Both progress from the first step on, neither waits for the other to finish.
    assert chunks(result, "a")[0] == (0, 24) and chunks(result, "b")[0] == (0, 24)
    assert_matches_reference(result, specs)


def test_adaptive_floors_the_cap_at_the_fair_share() -> None:
    cap = PrefillCap(threshold=8, adaptive=True, budget=64)
    assert cap.for_step(1) == 0  # alone: no cap
    assert cap.for_step(2) == 32  # 64 // 2 beats 8
    assert cap.for_step(16) == 8  # 64 // 16 = 4 is below the threshold
    assert PrefillCap(threshold=8, adaptive=False, budget=64).for_step(2) == 8
    assert PrefillCap(threshold=0, adaptive=True, budget=64).for_step(5) == 0


def test_random_arrivals_with_a_cap_match_the_reference() -> None:
    rng = random.Random(7)
    specs = [
        Spec(f"r{i}", prompt(rng.randint(1, 120), i), max_tokens=rng.randint(1, 12))
        for i in range(25)
    ]
    arrive_at = {s.request_id: rng.randint(0, 30) for s in specs}
    result = run_specs(
        make_scheduler(
            num_blocks=200, block_size=4, max_num_batched_tokens=48, max_num_seqs=6,
            long_prefill_token_threshold=20,
        ),
        specs, arrive_at,
    )
    assert_matches_reference(result, specs)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(long_prefill_token_threshold=-1), "must be >= 0"),
        (dict(long_prefill_token_threshold=5000, max_model_len=4096), "cannot be greater"),
        (
            dict(long_prefill_token_threshold=8, enable_chunked_prefill=False,
                 max_num_batched_tokens=4096, max_model_len=4096),
            "needs chunked prefill",
        ),
    ],
)
def test_bad_thresholds_are_refused_by_name(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match="long_prefill_token_threshold") as error:
        SchedulerConfig(**options)
    assert message in str(error.value)


def test_engine_options_reach_the_scheduler_config() -> None:
    config = make_engine_config(
        long_prefill_token_threshold=256, long_prefill_token_threshold_adaptive=True
    )
    assert config.scheduler.long_prefill_token_threshold == 256
    assert config.scheduler.long_prefill_token_threshold_adaptive is True


def test_command_line_flags_reach_the_engine_options() -> None:
    import argparse

    from inflight.entrypoints.engine_args import add_engine_args, engine_options

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    options = engine_options(parser.parse_args(
        ["--long-prefill-token-threshold", "512", "--long-prefill-token-threshold-adaptive"]
    ))
    assert options["long_prefill_token_threshold"] == 512
    assert options["long_prefill_token_threshold_adaptive"] is True
    assert engine_options(parser.parse_args([]))["long_prefill_token_threshold"] == 0
