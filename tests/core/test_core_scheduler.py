"""Scheduler behaviour with a fake model: budgets, chunking, joins, preemption, policies."""

from __future__ import annotations

import random

import pytest
from fake_engine import (
    FakeRunner,
    Spec,
    assert_matches_reference,
    drive,
    make_scheduler,
    next_token,
    reference_output,
    run_specs,
)

from inflight.core.request import RequestStatus


def prompt(n: int, seed: int = 0) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(1, 5000) for _ in range(n))


# ---------------------------------------------------------------- the fake itself


def test_reference_equals_running_alone_through_scheduler() -> None:
    spec = Spec("a", prompt(7), max_tokens=12, eos=(0,))
    result = run_specs(make_scheduler(), [spec])
    tokens, reason = reference_output(spec)
    assert result.outputs["a"] == tokens and result.finish_reasons["a"] == reason == "length"
    # The first token depends on the whole prompt, the second on the first.
    assert tokens[0] == next_token(spec.prompt)
    assert tokens[1] == next_token((*spec.prompt, tokens[0]))


def test_fake_runner_rejects_a_gap_in_the_history() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=4)
    scheduler.add_request(Spec("a", prompt(10)).make())
    runner = FakeRunner(block_size=16)
    runner.execute(scheduler.schedule())
    skipped = scheduler.schedule()  # chunk 0..3 was never applied, so this restarts at 0
    with pytest.raises(AssertionError, match="chunk starts at 0"):
        runner.execute(skipped)


# ---------------------------------------------------------------- 1. limits


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_token_budget_and_max_num_seqs_are_never_exceeded(policy: str) -> None:
    rng = random.Random(1)
    specs = [
        Spec(
            f"r{i}",
            prompt(rng.randint(1, 60), i),
            max_tokens=rng.randint(1, 30),
            priority=rng.randint(0, 3),
            arrival_time=i,
        )
        for i in range(30)
    ]
    scheduler = make_scheduler(
        num_blocks=40,
        block_size=4,
        max_num_batched_tokens=13,
        max_num_seqs=5,
        scheduling_policy=policy,
    )
    arrive_at = {s.request_id: rng.randint(0, 40) for s in specs}
    result = run_specs(scheduler, specs, arrive_at)
    per_step_tokens = [s.output.num_batched_tokens for s in result.steps]
    per_step_seqs = [len(s.output.scheduled) for s in result.steps]
    assert max(per_step_tokens) <= 13
    assert max(per_step_tokens) == 13  # the budget is actually used, not just respected
    assert max(per_step_seqs) <= 5
    assert max(per_step_seqs) == 5
    assert_matches_reference(result, specs)


# ---------------------------------------------------------------- 2. chunked prefill


def test_long_prompt_is_chunked_contiguously() -> None:
    spec = Spec("long", prompt(100), max_tokens=5)
    scheduler = make_scheduler(max_num_batched_tokens=16)
    result = run_specs(scheduler, [spec])
    items = [s.output.scheduled[0] for s in result.steps]
    prefill = [it for it in items if it.start_position < 100]
    assert [it.start_position for it in prefill] == [0, 16, 32, 48, 64, 80, 96]
    assert [it.num_tokens for it in prefill] == [16] * 6 + [4]
    assert [it.sample for it in prefill] == [False] * 6 + [True]
    assert all(it.is_prefill for it in prefill)
    assert list(spec.prompt) == [t for it in prefill for t in it.token_ids]
    decode = items[len(prefill) :]
    assert [it.start_position for it in decode] == [100, 101, 102, 103]
    assert all(it.num_tokens == 1 and it.sample and not it.is_prefill for it in decode)
    assert_matches_reference(result, [spec])


def test_chunks_share_the_budget_with_decodes() -> None:
    """A decode is served first; a long prompt takes only what budget is left."""
    specs = [Spec("short", prompt(3), max_tokens=20), Spec("long", prompt(50, 1), max_tokens=3)]
    scheduler = make_scheduler(max_num_batched_tokens=8)
    result = run_specs(scheduler, specs, {"long": 1})
    step1 = {s.request_id: s for s in result.steps[1].output.scheduled}
    assert step1["short"].num_tokens == 1
    assert step1["long"].num_tokens == 7 and step1["long"].start_position == 0
    assert_matches_reference(result, specs)


# ---------------------------------------------------------------- 3. joining at once


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_waiting_request_joins_the_step_after_a_finish(policy: str) -> None:
    specs = [
        Spec("a", prompt(5), max_tokens=4),
        Spec("b", prompt(6, 1), max_tokens=3),
        Spec("c", prompt(2, 2), max_tokens=2),
    ]
    scheduler = make_scheduler(max_num_seqs=1, scheduling_policy=policy)
    result = run_specs(scheduler, specs)
    assert result.finish_step["a"] == 3
    assert result.first_scheduled_step("b") == result.finish_step["a"] + 1
    assert result.first_scheduled_step("c") == result.finish_step["b"] + 1
    assert_matches_reference(result, specs)


def test_full_slots_refill_the_next_step() -> None:
    specs = [Spec(f"r{i}", prompt(4, i), max_tokens=m) for i, m in enumerate([2, 9, 5, 3, 4])]
    scheduler = make_scheduler(max_num_seqs=2)
    result = run_specs(scheduler, specs)
    for step, record in enumerate(result.steps[1:], start=1):
        finished_before = [u for u in result.steps[step - 1].updates if u.finished]
        waiting = len(result.steps[step - 1].waiting_after)
        assert len(record.admitted) == min(len(finished_before), waiting)
    assert_matches_reference(result, specs)


# ---------------------------------------------------------------- 4. preemption


def preemption_specs() -> list[Spec]:
    # "low" arrives (and is admitted) first but has the lowest priority.
    return [
        Spec("low", prompt(8, 1), max_tokens=16, priority=5, arrival_time=0),
        Spec("high", prompt(8, 2), max_tokens=16, priority=0, arrival_time=1),
        Spec("late", prompt(4, 3), max_tokens=4, priority=9, arrival_time=2),
    ]


@pytest.mark.parametrize("policy, victim", [("fcfs", "high"), ("priority", "low")])
def test_preemption_picks_the_right_victim_and_recomputes_exactly(policy: str, victim: str) -> None:
    # 6 blocks of 4 = 24 tokens: one request (8 + 16 - 1 = 23 tokens) fills the cache alone.
    specs = preemption_specs()
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=2, scheduling_policy=policy)
    result = run_specs(scheduler, specs, {"high": 1, "late": 2})
    assert scheduler.num_preemptions > 0
    preempting = [r for r in result.steps if r.output.preempted_request_ids]
    assert preempting
    first = preempting[0]
    assert first.running_before == ["low", "high"]
    assert first.output.preempted_request_ids == [victim]
    # Back at the head of waiting, ahead of the request that arrived after it.
    assert first.waiting_after == [victim, "late"]
    assert victim not in [s.request_id for s in first.output.scheduled]
    # No admission in a step that preempted.
    assert not first.admitted
    # The victim is recomputed from position 0 with its generated tokens, and is
    # re-admitted before "late".
    readmit_step = result.admit_steps[victim][1]
    late_step = result.first_scheduled_step("late")
    assert readmit_step < late_step or (
        readmit_step == late_step
        and result.steps[late_step].admitted.index(victim)
        < result.steps[late_step].admitted.index("late")
    )
    readmit = result.steps[readmit_step].output.scheduled
    (item,) = [s for s in readmit if s.request_id == victim]
    assert item.start_position == 0 and item.is_prefill
    assert len(item.token_ids) > 8
    assert_matches_reference(result, specs)
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_preempted_request_status_and_counters() -> None:
    specs = preemption_specs()[:2]
    scheduler = make_scheduler(num_blocks=6, block_size=4)
    requests = {s.request_id: s.make() for s in specs}
    seen: list[RequestStatus] = []

    def observe(step, sched, record) -> None:
        if record.output.preempted_request_ids:
            seen.append(requests["high"].status)

    drive(scheduler, arrivals={0: list(requests.values())}, observe=observe)
    assert seen and seen[0] is RequestStatus.PREEMPTED
    assert requests["high"].num_preemptions >= 1
    assert requests["low"].num_preemptions == 0
    assert scheduler.num_preemptions == requests["high"].num_preemptions


# ---------------------------------------------------------------- 5. policies


def test_priority_admits_the_more_urgent_request_first() -> None:
    specs = [
        Spec("first", prompt(3), max_tokens=3, priority=1, arrival_time=0),
        Spec("lazy", prompt(3, 1), max_tokens=3, priority=7, arrival_time=1),
        Spec("urgent", prompt(3, 2), max_tokens=3, priority=0, arrival_time=2),
        Spec("middle", prompt(3, 3), max_tokens=3, priority=3, arrival_time=3),
    ]
    arrive_at = {"first": 0, "lazy": 1, "urgent": 1, "middle": 2}
    order = {}
    for policy in ("fcfs", "priority"):
        scheduler = make_scheduler(max_num_seqs=1, scheduling_policy=policy)
        result = run_specs(scheduler, specs, arrive_at)
        order[policy] = sorted(result.admit_steps, key=result.first_scheduled_step)
        assert_matches_reference(result, specs)
    assert order["fcfs"] == ["first", "lazy", "urgent", "middle"]
    assert order["priority"] == ["first", "urgent", "middle", "lazy"]


def test_priority_ties_go_to_the_earlier_arrival() -> None:
    specs = [
        Spec(f"r{i}", prompt(2, i), max_tokens=2, priority=1, arrival_time=10 - i) for i in range(4)
    ]
    scheduler = make_scheduler(max_num_seqs=1, scheduling_policy="priority")
    result = run_specs(scheduler, specs)
    assert sorted(result.admit_steps, key=result.first_scheduled_step) == ["r3", "r2", "r1", "r0"]


# ---------------------------------------------------------------- 6. no block leaks


@pytest.mark.parametrize("seed", range(12))
def test_no_block_leak_after_finish_abort_and_preemption(seed: int) -> None:
    rng = random.Random(seed)
    policy = rng.choice(["fcfs", "priority"])
    specs = [
        Spec(
            f"r{i}",
            prompt(rng.randint(1, 30), i),
            max_tokens=rng.randint(1, 20),
            priority=rng.randint(0, 2),
            arrival_time=i,
            eos=(rng.randrange(10, 1010),),
        )
        for i in range(16)
    ]
    scheduler = make_scheduler(
        num_blocks=13,
        block_size=4,
        max_num_batched_tokens=rng.randint(4, 24),
        max_num_seqs=rng.randint(2, 6),
        scheduling_policy=policy,
    )
    arrive_at = {s.request_id: rng.randint(0, 10) for s in specs}
    ids = [s.request_id for s in specs]
    aborts: dict[int, list[str]] = {}
    aborts_mid: dict[int, list[str]] = {}
    for request_id in rng.sample(ids, 6):
        target = aborts if rng.random() < 0.5 else aborts_mid
        target.setdefault(arrive_at[request_id] + rng.randint(0, 15), []).append(request_id)
    result = run_specs(scheduler, specs, arrive_at, aborts=aborts, aborts_mid_step=aborts_mid)

    kv = scheduler.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    assert not scheduler.requests and not scheduler.running and len(scheduler.waiting) == 0
    assert scheduler.slots.num_free == scheduler.slots.num_slots
    for request_id in ids:  # every request ended exactly one way
        assert (request_id in result.aborted) != (request_id in result.finish_reasons)
    assert_matches_reference(result, specs)


def test_abort_waiting_running_and_mid_step() -> None:
    specs = [Spec(f"r{i}", prompt(10, i), max_tokens=30) for i in range(4)]
    scheduler = make_scheduler(num_blocks=12, block_size=4, max_num_seqs=2)
    result = run_specs(scheduler, specs, aborts={2: ["r3", "r0"]}, aborts_mid_step={4: ["r1"]})
    assert result.aborted == {"r0", "r1", "r3"}
    assert "r3" not in result.admit_steps  # aborted while waiting
    assert len(result.outputs["r1"]) == 4  # the step-4 token was dropped
    assert "r1" in result.steps[5].output.finished_request_ids
    assert scheduler.abort_request("r0") is None  # already gone
    assert scheduler.abort_request("nope") is None
    assert_matches_reference(result, specs)
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


# ---------------------------------------------------------------- 8. static vs continuous


def seed_example(n_extra: int = 0) -> list[Spec]:
    """The source document's worked example: one request of 500 steps, seven of 50."""
    lengths = [500] + [50] * 7 + [10] * n_extra
    return [
        Spec(f"r{i}", prompt(128, i), max_tokens=m, ignore_eos=True, arrival_time=i)
        for i, m in enumerate(lengths)
    ]


def test_static_batching_idles_as_in_the_seed_example() -> None:
    specs = seed_example(n_extra=2)
    scheduler = make_scheduler(
        num_blocks=1024,
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=1024,
        batching="static",
    )
    holders: list[int] = []
    result = run_specs(
        scheduler,
        specs,
        observe=lambda step, s, rec: holders.append(s.slots.num_slots - s.slots.num_free),
    )
    batch = {f"r{i}" for i in range(8)}
    batch_end = max(result.finish_step[r] for r in batch)
    assert batch_end == 499
    for extra in ("r8", "r9"):
        assert result.first_scheduled_step(extra) == batch_end + 1
    batch_steps = result.steps[: batch_end + 1]
    working = sum(len(s.output.scheduled) for s in batch_steps)
    slot_steps = 8 * len(batch_steps)
    assert abs(working - 850) <= 8 and abs(slot_steps - 4000) <= 8
    assert abs((1 - working / slot_steps) - 0.7875) < 0.01
    # Finished members keep their slots (idle) until the whole batch is done.
    assert holders[100] == 8 and len(batch_steps[100].output.scheduled) == 1
    assert_matches_reference(result, specs)


def test_continuous_batching_refills_at_once() -> None:
    specs = seed_example()
    runs = {}
    for mode in ("continuous", "static"):
        scheduler = make_scheduler(
            num_blocks=1024, max_num_seqs=4, max_num_batched_tokens=1024, batching=mode
        )
        runs[mode] = run_specs(scheduler, specs)
        assert_matches_reference(runs[mode], specs)
    result = runs["continuous"]
    for step in range(1, result.num_steps):
        prev = result.steps[step - 1]
        finished = [u.request_id for u in prev.updates if u.finished]
        expected = min(len(finished), len(prev.waiting_after))
        assert len(result.steps[step].admitted) == expected, step
    assert result.first_scheduled_step("r4") == 50  # r1..r3 finish at step 49
    assert result.first_scheduled_step("r7") == 100
    assert result.num_steps == 500
    assert runs["static"].num_steps == 550  # the second batch waits for the 500-step request


def test_static_batch_waits_for_a_preempted_member() -> None:
    """A preempted member stays in its batch: it comes back before any newcomer joins."""
    specs = [
        Spec("a", prompt(8, 1), max_tokens=16, ignore_eos=True),
        Spec("b", prompt(8, 2), max_tokens=16, ignore_eos=True),
        Spec("c", prompt(4, 3), max_tokens=3, ignore_eos=True),
    ]
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=2, batching="static")
    result = run_specs(scheduler, specs)
    assert scheduler.num_preemptions > 0
    assert len(result.admit_steps["b"]) > 1  # b was preempted and re-admitted
    assert result.first_scheduled_step("c") == result.finish_step["b"] + 1
    assert_matches_reference(result, specs)


def test_token_of_an_aborted_request_never_reaches_a_new_one_with_its_id() -> None:
    scheduler = make_scheduler()
    old = Spec("x", prompt(4), max_tokens=5).make()
    scheduler.add_request(old)
    output = scheduler.schedule()
    runner_output = FakeRunner().execute(output)
    scheduler.abort_request("x")
    new = Spec("x", prompt(6, 1), max_tokens=5).make()
    scheduler.add_request(new)  # a client retry with the same id, while the step ran
    updates = scheduler.update_from_output(output, runner_output)
    assert updates == []
    assert new.output_token_ids == [] and new.num_computed_tokens == 0
    scheduler.check_invariants()


def test_a_huge_max_num_seqs_costs_what_runs() -> None:
    """max_num_seqs=10**12 (a planner sweep may ask) builds at once; slots are still
    taken lowest first and refilled."""
    from inflight.core.slots import SlotTable

    slots = SlotTable(10**12)
    assert [slots.assign(r) for r in "abc"] == [0, 1, 2]
    slots.release("b")
    assert slots.assign("d") == 1 and slots.assign("e") == 3
    assert slots.owners == ["a", "d", "c", "e"] and slots.num_free == 10**12 - 4
