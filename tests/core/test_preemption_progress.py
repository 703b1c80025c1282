"""Memory pressure never livelocks: a resumed request is not preempted again and again.

A KV cache of a handful of blocks, a small token budget (so recomputing a preempted
request's history takes several steps) and several long requests. vLLM users report
the failure this guards against: the victim was the most recently *admitted* running
request, and a request resumed after a preemption is admitted last, so it was the next
victim again before its recompute even finished. The scheduler now preempts the
latest-*arriving* request, so the oldest one is never the victim while another runs.

Progress is tracked from outside the scheduler: each request's output-token count at
each of its preemptions. What victim choice guarantees is that the oldest unfinished
request is never preempted (it alone always fits the cache, so it progresses every
step it is scheduled and finishes; then the next oldest, ...). A *younger* request may
still be preempted twice before a new token when an older one keeps needing blocks
while the younger one's chunked recompute is under way; the tracker checks that this
only ever happens for a request with an older one running.
"""

from __future__ import annotations

import random

import pytest
from fake_engine import (
    Spec,
    StepRecord,
    assert_matches_reference,
    make_scheduler,
    run_specs,
)

from inflight.config import SchedulerConfig
from inflight.core.kv_cache_manager import KVCacheManager
from inflight.core.request import Request
from inflight.core.scheduler import Scheduler


def prompt(n: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(1, 5000) for _ in range(n))


class ProgressTracker:
    """Per request, its output-token count at each preemption; checked after each step."""

    def __init__(self, specs: list[Spec]) -> None:
        self.order = [s.request_id for s in specs]  # arrival order
        self.at_preemption: dict[str, list[int]] = {rid: [] for rid in self.order}
        self.finished: set[str] = set()
        self.num_preemptions = 0
        self.num_repeated = 0  # preemptions of a request that gained no token since its last

    def observe(self, step: int, scheduler: Scheduler, record: StepRecord) -> None:
        # Block accounting, queue consistency (drive checks it too, before and after).
        scheduler.check_invariants()
        kv_cache = scheduler.kv_cache
        held = {b for r in scheduler.running for b in kv_cache.get_block_ids(r.request_id)}
        # Every used block is held by a running request; the rest are free (or cached-free).
        assert len(held) == kv_cache.pool.num_used_blocks
        assert kv_cache.num_free_blocks + len(held) == kv_cache.num_blocks
        oldest = next(rid for rid in self.order if rid not in self.finished)
        for victim in record.output.preempted_request_ids:
            self.num_preemptions += 1
            assert victim != oldest, f"step {step}: the oldest request {oldest} was preempted"
            request = scheduler.requests[victim]
            counts = self.at_preemption.setdefault(victim, [])
            if counts and request.num_output_tokens <= counts[-1]:
                # Preempted again before a new token: allowed only for a younger request
                # giving way to an older one that needed its blocks (never the oldest).
                assert any(
                    self.order.index(rid) < self.order.index(victim)
                    for rid in record.running_before
                ), f"step {step}: {victim} preempted again without progress, for no older one"
                self.num_repeated += 1
            counts.append(request.num_output_tokens)
        self.finished.update(u.request_id for u in record.updates if u.finished)


def long_requests(count: int, prompt_len: int, max_tokens: int) -> list[Spec]:
    return [
        Spec(f"r{i}", prompt(prompt_len, seed=i), max_tokens=max_tokens, ignore_eos=True,
             arrival_time=float(i))
        for i in range(count)
    ]


# (num_blocks, block_size, budget, max_num_seqs, count, prompt_len, max_tokens, prefix)
SCENARIOS = [
    pytest.param(8, 4, 4, 4, 4, 12, 18, False, id="8-blocks-budget-4"),
    pytest.param(6, 4, 3, 3, 3, 8, 15, False, id="6-blocks-budget-3"),
    pytest.param(10, 2, 5, 5, 5, 9, 10, True, id="10-blocks-prefix-caching"),
    pytest.param(5, 4, 2, 2, 6, 6, 13, False, id="5-blocks-budget-2"),
]


@pytest.mark.parametrize(
    "num_blocks, block_size, budget, max_num_seqs, count, prompt_len, max_tokens, prefix",
    SCENARIOS,
)
def test_every_request_finishes_and_no_request_is_preempted_twice_without_progress(
    num_blocks: int, block_size: int, budget: int, max_num_seqs: int, count: int,
    prompt_len: int, max_tokens: int, prefix: bool,
) -> None:
    specs = long_requests(count, prompt_len, max_tokens)
    scheduler = make_scheduler(
        num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=prefix,
        max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
    )
    # Each request alone fits the cache (else the scheduler refuses it at once) ...
    assert all(
        scheduler.kv_cache.blocks_needed(prompt_len + max_tokens - 1) <= num_blocks
        for _ in specs
    )
    tracker = ProgressTracker(specs)
    result = run_specs(scheduler, specs, observe=tracker.observe, max_steps=5_000)
    # ... but not all together: memory pressure, so preemptions happen.
    assert tracker.num_preemptions > 0
    assert sorted(result.finish_reasons) == sorted(s.request_id for s in specs)
    assert_matches_reference(result, specs)
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks
    assert not scheduler.running and len(scheduler.waiting) == 0


@pytest.mark.parametrize("seed", range(40))
def test_random_pressure_never_preempts_the_oldest_request(seed: int) -> None:
    """Random long requests arriving over time on a tiny cache: all finish, exactly, and
    the oldest unfinished request is never the victim."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    num_blocks = rng.randint(4, 10)
    capacity = num_blocks * block_size
    specs: list[Spec] = []
    arrive_at: dict[str, int] = {}
    step = 0
    for i in range(rng.randint(3, 8)):
        prompt_len = rng.randint(1, capacity // 2)
        max_tokens = rng.randint(1, capacity - prompt_len + 1)
        specs.append(Spec(f"r{i}", prompt(prompt_len, seed * 100 + i), max_tokens=max_tokens,
                          ignore_eos=True, arrival_time=float(i)))
        arrive_at[f"r{i}"] = step
        step += rng.randint(0, 3)
    scheduler = make_scheduler(
        num_blocks=num_blocks, block_size=block_size,
        enable_prefix_caching=rng.random() < 0.5,
        max_num_batched_tokens=rng.randint(1, 8), max_num_seqs=rng.randint(2, 6),
    )
    tracker = ProgressTracker(specs)
    tracker.at_preemption = {}  # only the oldest-request property is universal here

    def observe(step: int, sched: Scheduler, record: StepRecord) -> None:
        oldest = next((r for r in tracker.order if r not in tracker.finished), None)
        assert oldest not in record.output.preempted_request_ids, (
            f"step {step}: the oldest request {oldest} was preempted"
        )
        sched.check_invariants()
        tracker.finished.update(u.request_id for u in record.updates if u.finished)

    result = run_specs(scheduler, specs, arrive_at, observe=observe, max_steps=20_000)
    assert sorted(result.finish_reasons) == sorted(s.request_id for s in specs)
    assert_matches_reference(result, specs)
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


class HeldUntil:
    """A readiness check (as the structured-output manager's) that holds ``request_id``
    back until the scheduler's ``step``: younger requests are admitted before it."""

    def __init__(self, scheduler_ref: list[Scheduler], request_id: str, step: int) -> None:
        self._scheduler = scheduler_ref
        self._request_id = request_id
        self._step = step

    def is_ready(self, request: Request) -> bool:
        return request.request_id != self._request_id or self._scheduler[0]._step_id >= self._step


@pytest.mark.parametrize("hold_steps", [1, 3, 6])
def test_oldest_request_admitted_last_is_not_the_next_victim(hold_steps: int) -> None:
    """The oldest request is admitted after younger ones (its grammar was compiling): it
    is never preempted, and so is never preempted twice before it makes progress."""
    specs = long_requests(4, prompt_len=10, max_tokens=20)
    ref: list[Scheduler] = []
    config = SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=4)
    scheduler = Scheduler(config, KVCacheManager(8, 4, False), HeldUntil(ref, "r0", hold_steps))
    ref.append(scheduler)
    tracker = ProgressTracker(specs)
    result = run_specs(scheduler, specs, observe=tracker.observe, max_steps=5_000)
    assert tracker.num_preemptions > 0
    assert not tracker.at_preemption.get("r0")
    assert sorted(result.finish_reasons) == sorted(s.request_id for s in specs)
    assert_matches_reference(result, specs)
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks
