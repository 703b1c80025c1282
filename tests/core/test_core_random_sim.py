"""Seeded random simulation: chunking, preemption, aborts and prefix caching never change
any token.

Each trial draws a workload (prompt lengths, output lengths, stop tokens, arrivals, aborts)
and an engine shape (block size, a KV cache just big enough for the largest request, a
tiny token budget, few sequences, either policy, either batching mode, prefix caching on
or off, half the prompts sharing a prefix with an earlier one), drives it with
the fake runner (which checks invariants every step) and compares every surviving
request with the same request run alone.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from fake_engine import (
    DriveResult,
    Spec,
    StepRecord,
    assert_matches_reference,
    drive,
    reference_output,
)

from inflight.config import SchedulerConfig
from inflight.core.kv_cache_manager import KVCacheManager
from inflight.core.scheduler import Scheduler

NUM_TRIALS = 400


def blocks_for(spec: Spec, max_model_len: int, block_size: int) -> int:
    """KV blocks the request needs at its longest (its last token is never cached)."""
    prompt_len = len(spec.prompt)
    room = max(1, max_model_len - prompt_len)
    limit = room if spec.max_tokens is None else min(spec.max_tokens, room)
    return -(-max(prompt_len + limit - 1, prompt_len) // block_size)


def draw_spec(
    rng: random.Random, index: int, max_model_len: int, earlier: Sequence[Spec] = ()
) -> Spec:
    # A prompt of max_model_len tokens is rejected (no room for an output token), as in vLLM.
    length = rng.randint(1, min(80, max_model_len - 1))
    prompt = tuple(rng.randrange(0, 3000) for _ in range(length))
    if earlier and rng.random() < 0.5:  # share a prefix with an earlier prompt (prefix cache)
        base = rng.choice(earlier).prompt
        keep = rng.randint(0, len(base))
        prompt = (base[:keep] + prompt)[: max(length, keep)]
    max_tokens = rng.randint(1, 40)
    spec = Spec(
        f"r{index}",
        prompt,
        max_tokens=max_tokens,
        priority=rng.randint(0, 3),
        arrival_time=float(index),
    )
    # Stop tokens that actually occur: taken from the request's own unconstrained output.
    free_run, _ = reference_output(spec, max_model_len)
    kind = rng.random()
    if kind < 0.25:
        spec = Spec(**{**spec.__dict__, "eos": (rng.choice(free_run),)})
    elif kind < 0.35:
        spec = Spec(**{**spec.__dict__, "eos": (rng.choice(free_run),), "ignore_eos": True})
    elif kind < 0.45:
        spec = Spec(**{**spec.__dict__, "stop_token_ids": (rng.choice(free_run),)})
    elif kind < 0.55:
        spec = Spec(
            **{
                **spec.__dict__,
                "eos": (rng.choice(free_run),),
                "min_tokens": rng.randint(0, max_tokens),
            }
        )
    return spec


def check_victims(
    record: StepRecord, policy: str, priority_of: dict[str, tuple], added: dict[str, int]
) -> None:
    preempted = record.output.preempted_request_ids
    if not preempted:
        return
    assert not record.admitted, "admitted a request in a step that preempted"
    remaining = list(record.running_before)
    for victim in preempted:
        if policy == "fcfs":
            # The latest-added running request (not the latest admitted: a resumed
            # request must not be the next victim again) ...
            expected = max(remaining, key=lambda rid: added[rid])
        else:
            expected = max(remaining, key=lambda rid: (*priority_of[rid], added[rid]))
        assert victim == expected, f"preempted {victim}, expected {expected}"
        remaining.remove(victim)
    if policy == "fcfs":
        # ... and back at the head of waiting, in the order they were added.
        assert record.waiting_after[: len(preempted)] == preempted[::-1]
    for victim in preempted:
        assert victim not in {s.request_id for s in record.output.scheduled}


def check_work_conserving(record: StepRecord, budget: int) -> None:
    """A running request is left out of a step only when the token budget is used up."""
    scheduled = {s.request_id for s in record.output.scheduled}
    preempted = set(record.output.preempted_request_ids)
    idle = [r for r in record.running_before if r not in scheduled and r not in preempted]
    # A chunk that stops short of the request's end was cut by the budget. (Not checked
    # in a step that preempted: like vLLM, a chunk sized before a preemption gave budget
    # back is not regrown.)
    if not preempted:
        idle += [s.request_id for s in record.output.scheduled if not s.sample]
    if idle:
        assert record.output.num_batched_tokens == budget, (
            f"{idle} got less than they need with {budget - record.output.num_batched_tokens} "
            "tokens of budget left"
        )


def check_admission_order(record: StepRecord, batching: str) -> None:
    """Waiting requests are admitted strictly in queue order: no one jumps the head."""
    if batching == "continuous":
        assert record.admitted == record.waiting_before[: len(record.admitted)]
    else:
        order = [rid for rid in record.waiting_before if rid in record.admitted]
        assert record.admitted == order


class StaticBatchTracker:
    """Static batching: a new batch starts only when every member of the last one ended."""

    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.batch: set[str] = set()
        self.seen: set[str] = set()

    def observe(self, record: StepRecord, result_ended: set[str]) -> None:
        for rid in record.admitted:
            if rid in self.seen:
                assert rid in self.batch, f"{rid} re-admitted outside its batch"
                continue
            self.seen.add(rid)
            if self.batch <= result_ended:
                self.batch = set()
            self.batch.add(rid)
            assert len(self.batch) <= self.max_num_seqs, (
                f"{rid} joined a static batch whose members {sorted(self.batch)} are not all done"
            )


def run_trial(seed: int) -> DriveResult:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 16])
    max_model_len = rng.choice([8192, rng.randint(8, 120)])
    specs: list[Spec] = []
    for i in range(rng.randint(1, 10)):
        specs.append(draw_spec(rng, i, max_model_len, specs))
    prefix_caching = rng.random() < 0.5
    policy = rng.choice(["fcfs", "priority"])
    chunked = rng.random() < 0.85
    budget = rng.randint(1, 40) if chunked else max_model_len
    config = SchedulerConfig(
        max_num_seqs=rng.randint(1, 5),
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        scheduling_policy=policy,
        batching=rng.choice(["continuous"] * 4 + ["static"]),
    )
    need = max(blocks_for(s, max_model_len, block_size) for s in specs)
    kv_cache = KVCacheManager(need + rng.randint(0, 3), block_size, prefix_caching)
    scheduler = Scheduler(config, kv_cache)

    arrivals: dict[int, list] = {}
    arrive_at = {}
    for spec in specs:
        arrive_at[spec.request_id] = step = rng.randint(0, 30)
        arrivals.setdefault(step, []).append(spec.make())
    aborts: dict[int, list[str]] = {}
    aborts_mid: dict[int, list[str]] = {}
    for spec in specs:
        if rng.random() < 0.15:
            target = aborts if rng.random() < 0.5 else aborts_mid
            step = arrive_at[spec.request_id] + rng.randint(0, 40)
            target.setdefault(step, []).append(spec.request_id)

    priority_of = {s.request_id: (s.priority, s.arrival_time) for s in specs}
    added = {
        r.request_id: i
        for i, r in enumerate(r for step in sorted(arrivals) for r in arrivals[step])
    }
    tracker = StaticBatchTracker(config.max_num_seqs)
    ended: set[str] = set()

    def observe(step: int, sched: Scheduler, record: StepRecord) -> None:
        check_victims(record, policy, priority_of, added)
        check_admission_order(record, config.batching)
        check_work_conserving(record, budget)
        if policy == "priority":
            keys = [priority_of[rid] for rid in record.waiting_after]
            assert keys == sorted(keys), "the waiting queue is not in priority order"
        # Requests aborted before this step are reported in its finished_request_ids.
        ended.update(record.output.finished_request_ids)
        if config.batching == "static":
            tracker.observe(record, ended)
        ended.update(u.request_id for u in record.updates if u.finished)
        if not chunked:
            for item in record.output.scheduled:
                assert item.sample, "a prompt was chunked with chunked prefill off"

    result = drive(
        scheduler,
        arrivals=arrivals,
        aborts=aborts,
        aborts_mid_step=aborts_mid,
        observe=observe,
        max_steps=20_000,
    )
    assert_matches_reference(result, specs, max_model_len)
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks
    assert not scheduler.requests and not scheduler.running and len(scheduler.waiting) == 0
    for spec in specs:
        rid = spec.request_id
        assert (rid in result.aborted) != (rid in result.finish_reasons), rid
    return result


def test_random_simulation_matches_reference() -> None:
    preemptions = chunks = stops = aborted = cached = 0
    for seed in range(NUM_TRIALS):
        try:
            result = run_trial(seed)
        except AssertionError as error:
            pytest.fail(f"trial seed={seed}: {error}")
        preemptions += sum(len(r.output.preempted_request_ids) for r in result.steps)
        chunks += sum(
            1 for r in result.steps for s in r.output.scheduled if s.is_prefill and not s.sample
        )
        stops += sum(1 for reason in result.finish_reasons.values() if reason == "stop")
        aborted += len(result.aborted)
        cached += sum(s.num_cached_tokens for r in result.steps for s in r.output.scheduled)
    # The workload really exercised what it claims to check.
    assert preemptions > 100, preemptions
    assert chunks > 100, chunks
    assert stops > 50, stops
    assert aborted > 20, aborted
    assert cached > 1000, cached
