"""long_prefill_token_threshold and max_long_partial_prefills (vLLM's names): a long
prompt takes at most the threshold per step while another request runs or waits (alone,
the whole budget); or, with a long limit, long prompts go one (or n) per step, uncapped,
while shorter prompts and decodes pass them."""

from __future__ import annotations

import random

import pytest
from fake_engine import Spec, assert_matches_reference, make_scheduler, run_specs

from inflight.config import CacheConfig, SchedulerConfig, make_engine_config
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


def test_long_limit_serves_long_prompts_one_after_another() -> None:
    specs = [
        Spec("first", prompt(120), max_tokens=4),
        Spec("second", prompt(200, 1), max_tokens=4),
        Spec("short", prompt(20, 2), max_tokens=4),
    ]
    options = dict(max_num_batched_tokens=512, long_prefill_token_threshold=64)
    serial = run_specs(make_scheduler(**options, max_long_partial_prefills=1), specs)
    # The first long prompt whole in step 0 (no cap), the short one beside it; the second
    # long one waits for step 1, then takes its whole prompt there.
    assert chunks(serial, "first") == [(0, 120)]
    assert chunks(serial, "short") == [(0, 20)]
    assert chunks(serial, "second") == [(1, 200)]
    assert_matches_reference(serial, specs)
    # Without the limit all three share step 0 (and the threshold alone would cap them).
    together = run_specs(make_scheduler(max_num_batched_tokens=512), specs)
    assert [chunks(together, r)[0][0] for r in ("first", "second", "short")] == [0, 0, 0]


def test_long_limit_lets_a_running_long_prompt_finish_first() -> None:
    """A long prompt chunked by the budget keeps the long slot until its prompt is done;
    a long newcomer waits, a short one joins as soon as the budget has room."""
    specs = [Spec("a", prompt(300), max_tokens=3), Spec("b", prompt(150, 1), max_tokens=3),
             Spec("c", prompt(10, 2), max_tokens=3)]
    result = run_specs(
        make_scheduler(max_num_batched_tokens=128, long_prefill_token_threshold=32,
                       max_long_partial_prefills=1),
        specs, {"b": 1, "c": 1},
    )
    assert [step for step, _ in chunks(result, "a")] == [0, 1, 2]
    # Step 2: a's last 44 tokens (still long) and the short c; b only after a is done.
    assert chunks(result, "c")[0][0] == 2
    assert chunks(result, "b")[0][0] == 3
    assert_matches_reference(result, specs)


@pytest.mark.parametrize("max_long", [1, 2])
def test_random_arrivals_with_a_long_limit_match_the_reference(max_long: int) -> None:
    rng = random.Random(11 + max_long)
    specs = [
        Spec(f"r{i}", prompt(rng.randint(1, 150), i), max_tokens=rng.randint(1, 10))
        for i in range(25)
    ]
    arrive_at = {s.request_id: rng.randint(0, 20) for s in specs}

    def observe(step, scheduler, record) -> None:
        long = [
            item for item in record.output.scheduled
            if item.is_prefill and scheduler_remaining[item.request_id] > 24
        ]
        assert len(long) <= max_long

    scheduler = make_scheduler(
        num_blocks=300, block_size=4, max_num_batched_tokens=64, max_num_seqs=8,
        long_prefill_token_threshold=24, max_long_partial_prefills=max_long,
    )
    # Tokens each request had left when its step was planned, from the scheduled items.
    scheduler_remaining: dict[str, int] = {}
    original = scheduler.schedule

    def schedule():
        for request in [*scheduler.running, *scheduler.waiting]:
            scheduler_remaining[request.request_id] = (
                request.num_tokens - request.num_computed_tokens
            )
        return original()

    scheduler.schedule = schedule  # type: ignore[method-assign]
    result = run_specs(scheduler, specs, arrive_at, observe=observe)
    assert_matches_reference(result, specs)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(long_prefill_token_threshold=-1), "must be >= 0"),
        (dict(max_long_partial_prefills=1), "needs long_prefill_token_threshold"),
        (dict(max_long_partial_prefills=-1), "must be >= 0"),
        (dict(long_prefill_token_threshold=32.5), "must be an integer"),
        (dict(long_prefill_token_threshold="32"), "must be an integer"),
        (dict(long_prefill_token_threshold=True), "must be an integer"),
        (dict(long_prefill_token_threshold_adaptive="yes"), "True or False"),
        (dict(long_prefill_token_threshold_adaptive=True), "needs a threshold > 0"),
        (
            dict(long_prefill_token_threshold=8, max_long_partial_prefills=1,
                 long_prefill_token_threshold_adaptive=True),
            "no max_long_partial_prefills",
        ),
        (dict(long_prefill_token_threshold=5000, max_model_len=4096), "cannot be greater"),
        (
            dict(long_prefill_token_threshold=8, enable_chunked_prefill=False,
                 max_num_batched_tokens=4096, max_model_len=4096),
            "needs chunked prefill",
        ),
    ],
)
def test_bad_thresholds_are_refused_by_name(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match="long_prefill|long_partial") as error:
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
        ["--long-prefill-token-threshold", "512", "--long-prefill-token-threshold-adaptive",
         "--max-long-partial-prefills", "1"]
    ))
    assert options["long_prefill_token_threshold"] == 512
    assert options["max_long_partial_prefills"] == 1
    assert options["long_prefill_token_threshold_adaptive"] is True
    assert engine_options(parser.parse_args([]))["long_prefill_token_threshold"] == 0


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: SchedulerConfig(max_num_seqs=4.5), "max_num_seqs"),
        (lambda: SchedulerConfig(max_num_batched_tokens="512"), "max_num_batched_tokens"),
        (lambda: SchedulerConfig(enable_chunked_prefill=1), "enable_chunked_prefill"),
        (lambda: CacheConfig(block_size=16.0), "block_size"),
        (lambda: CacheConfig(num_kv_blocks="64"), "num_kv_blocks"),
    ],
)
def test_options_of_the_wrong_type_are_refused_by_name(make, name: str) -> None:
    """A float or string where an integer belongs would otherwise pass validation and
    fail later, deep inside a step, with a bare TypeError."""
    with pytest.raises(ValueError, match=f"^{name} must be"):
        make()
