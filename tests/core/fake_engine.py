"""A fake model and a step loop for testing the pure scheduler core (no torch).

``FakeRunner`` plays the model: it rebuilds each request's token history from what the
scheduler sends (``start_position`` + ``token_ids``) and "samples" a token that depends on
the whole history, so a skipped, repeated or misplaced chunk, a wrong recompute after
preemption or a wrong decode token changes every later token.

``drive`` runs schedule -> runner -> update_from_output, checks the scheduler's invariants
and the step limits after every step, and records everything for assertions.

``reference_output`` computes what a request must produce when it runs alone with
unlimited resources, written independently of the scheduler's own stop checks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from inflight.config import SchedulerConfig
from inflight.core.interface import (
    ModelRunnerOutput,
    RequestUpdate,
    ScheduledRequest,
    SchedulerOutput,
)
from inflight.core.kv_cache_manager import KVCacheManager
from inflight.core.request import Request
from inflight.core.scheduler import Scheduler
from inflight.sampling_params import SamplingParams


def next_token(history: Sequence[int]) -> int:
    """The fake model: a deterministic function of the whole token history."""
    return (sum(history) * 31 + len(history)) % 1000 + 10


class FakeRunner:
    """Answers a SchedulerOutput with one token per ``sample=True`` request.

    Like a real runner it keeps per-request state (here the tokens by position, standing
    in for the KV cache) and drops it when the scheduler reports a request preempted or
    finished. With a ``block_size`` it also keeps the contents of every KV block, written
    through the block tables, and rebuilds each history by reading those blocks back, so
    a prefix-cache hit on the wrong block, or a shared block overwritten by another
    request, changes the sampled tokens. It asserts what a real runner would need to be
    true: each chunk continues exactly where the computed tokens end (a request admitted
    with a prefix-cache hit starts right after its cached tokens), the block table covers
    the chunk, and no block is written by one request while another holds it in the step.
    """

    def __init__(self, block_size: int | None = None) -> None:
        self.block_size = block_size
        self.histories: dict[str, dict[int, int]] = {}
        self.blocks: dict[int, dict[int, int]] = {}  # block id -> offset -> token
        self.num_calls = 0

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.num_calls += 1
        for request_id in scheduler_output.preempted_request_ids:
            self.histories.pop(request_id, None)
        for request_id in scheduler_output.finished_request_ids:
            self.histories.pop(request_id, None)
        sampled: dict[str, int] = {}
        seen: set[str] = set()
        self._check_writes(scheduler_output)
        for item in scheduler_output.scheduled:
            assert item.request_id not in seen, f"{item.request_id} scheduled twice in a step"
            seen.add(item.request_id)
            assert item.token_ids, f"{item.request_id} scheduled with no tokens"
            if not item.is_prefill:  # a decode is exactly one token, then a sample
                assert item.num_tokens == 1 and item.sample, f"{item.request_id}: bad decode"
            history = self.histories.get(item.request_id)
            if history is None:
                history = self._admit(item)
            assert item.start_position == len(history), (
                f"{item.request_id}: chunk starts at {item.start_position} but the cache "
                f"holds {len(history)} tokens"
            )
            for offset, token in enumerate(item.token_ids):
                history[item.start_position + offset] = token
            end = item.start_position + item.num_tokens
            if self.block_size is not None:
                assert len(item.block_ids) * self.block_size >= end, (
                    f"{item.request_id}: {len(item.block_ids)} blocks cannot hold {end} tokens"
                )
                assert len(set(item.block_ids)) == len(item.block_ids)
                self._write(item)
                # What attention would see: the history as stored in the blocks.
                history = {p: self._read(item.block_ids, p) for p in range(end)}
            if item.sample:
                sampled[item.request_id] = next_token([history[p] for p in range(end)])
        return ModelRunnerOutput(sampled_token_ids=sampled)

    def _admit(self, item: ScheduledRequest) -> dict[int, int]:
        """A request the runner holds nothing for: it starts at 0, or right after the
        tokens the scheduler says came from the prefix cache (read from those blocks)."""
        assert item.start_position == item.num_cached_tokens, (
            f"{item.request_id}: first chunk at {item.start_position} with "
            f"{item.num_cached_tokens} cached tokens"
        )
        history: dict[int, int] = {}
        if item.num_cached_tokens:
            assert self.block_size is not None
            assert item.num_cached_tokens % self.block_size == 0
            for p in range(item.num_cached_tokens):
                history[p] = self._read(item.block_ids, p)
        self.histories[item.request_id] = history
        return history

    def _check_writes(self, scheduler_output: SchedulerOutput) -> None:
        if self.block_size is None:
            return
        size = self.block_size
        written: dict[int, str] = {}
        for item in scheduler_output.scheduled:
            end = item.start_position + item.num_tokens
            for index in range(item.start_position // size, (end - 1) // size + 1):
                written[item.block_ids[index]] = item.request_id
        for item in scheduler_output.scheduled:
            for block_id in item.block_ids:
                writer = written.get(block_id, item.request_id)
                assert writer == item.request_id, (
                    f"block {block_id} is written by {writer} while {item.request_id} holds it"
                )

    def _write(self, item: ScheduledRequest) -> None:
        assert self.block_size is not None
        for offset, token in enumerate(item.token_ids):
            position = item.start_position + offset
            block = self.blocks.setdefault(item.block_ids[position // self.block_size], {})
            block[position % self.block_size] = token

    def _read(self, block_ids: list[int], position: int) -> int:
        assert self.block_size is not None
        block = self.blocks.get(block_ids[position // self.block_size], {})
        offset = position % self.block_size
        assert offset in block, f"position {position} was never written"
        return block[offset]


@dataclass
class StepRecord:
    output: SchedulerOutput
    updates: list[RequestUpdate]
    # Running and waiting request ids (in order) just before schedule() was called.
    running_before: list[str]
    waiting_before: list[str]
    # Request ids that entered the running list in this step.
    admitted: list[str]
    # The waiting queue's order right after schedule().
    waiting_after: list[str]


@dataclass
class DriveResult:
    steps: list[StepRecord] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    finish_reasons: dict[str, str | None] = field(default_factory=dict)
    stop_reasons: dict[str, int | str | None] = field(default_factory=dict)
    finish_step: dict[str, int] = field(default_factory=dict)
    # Every step in which each request entered the running list (re-admissions included).
    admit_steps: dict[str, list[int]] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    def first_scheduled_step(self, request_id: str) -> int:
        return self.admit_steps[request_id][0]

    def scheduled_ids(self, step: int) -> list[str]:
        return [s.request_id for s in self.steps[step].output.scheduled]


def drive(
    scheduler: Scheduler,
    runner: FakeRunner | None = None,
    *,
    arrivals: Mapping[int, Iterable[Request]] | None = None,
    aborts: Mapping[int, Iterable[str]] | None = None,
    aborts_mid_step: Mapping[int, Iterable[str]] | None = None,
    observe: Callable[[int, Scheduler, StepRecord], None] | None = None,
    max_steps: int = 100_000,
) -> DriveResult:
    """Run the step loop until no request is left and no arrival is pending.

    ``arrivals[k]`` are added and ``aborts[k]`` aborted before step ``k`` is scheduled;
    ``aborts_mid_step[k]`` are aborted after step ``k`` ran but before its output is
    applied (as a client disconnect during the forward pass would).
    """
    if runner is None:
        runner = FakeRunner(scheduler.kv_cache.block_size)
    arrivals = arrivals or {}
    aborts = aborts or {}
    aborts_mid_step = aborts_mid_step or {}
    last_event = max([*arrivals, *aborts, *aborts_mid_step, -1])
    config = scheduler.config
    result = DriveResult()
    step = 0
    while True:
        for request in arrivals.get(step, ()):
            scheduler.add_request(request)
            # A finished id may be reused; its outputs then accumulate.
            result.finish_reasons.pop(request.request_id, None)
        for request_id in aborts.get(step, ()):
            if scheduler.abort_request(request_id) is not None:
                result.aborted.add(request_id)
        if not scheduler.has_unfinished_requests() and step > last_event:
            break
        assert step < max_steps, f"no end after {max_steps} steps"

        running_before = [r.request_id for r in scheduler.running]
        waiting_before = [r.request_id for r in scheduler.waiting]
        had_work = scheduler.has_unfinished_requests()
        output = scheduler.schedule()
        waiting_after = [r.request_id for r in scheduler.waiting]
        scheduler.check_invariants()
        assert output.step_id == step
        assert output.num_batched_tokens <= config.max_num_batched_tokens
        assert len(output.scheduled) <= config.max_num_seqs
        assert len(scheduler.running) <= config.max_num_seqs
        if had_work:
            assert not output.is_empty, f"step {step}: requests are left but nothing ran"
        slots = [s.slot for s in output.scheduled]
        assert len(set(slots)) == len(slots), f"step {step}: two requests in one slot"
        assert all(0 <= slot < config.max_num_seqs for slot in slots)
        before = set(running_before)
        admitted = [s.request_id for s in output.scheduled if s.request_id not in before]
        for request_id in admitted:
            result.admit_steps.setdefault(request_id, []).append(step)

        runner_output = runner.execute(output)
        for request_id in aborts_mid_step.get(step, ()):
            if scheduler.abort_request(request_id) is not None:
                result.aborted.add(request_id)
        updates = scheduler.update_from_output(output, runner_output)
        scheduler.check_invariants()
        if config.batching == "continuous":  # a slot is held exactly while running
            held = {owner for owner in scheduler.slots.owners if owner is not None}
            assert held == {r.request_id for r in scheduler.running}, f"step {step}: slots"

        for update in updates:
            assert update.request_id not in result.finish_reasons, "update after finish"
            result.outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
            if update.finished:
                result.finish_reasons[update.request_id] = update.finish_reason
                result.stop_reasons[update.request_id] = update.stop_reason
                result.finish_step[update.request_id] = step
        record = StepRecord(
            output=output,
            updates=updates,
            running_before=running_before,
            waiting_before=waiting_before,
            admitted=admitted,
            waiting_after=waiting_after,
        )
        result.steps.append(record)
        if observe is not None:
            observe(step, scheduler, record)
        step += 1
    return result


@dataclass(frozen=True)
class Spec:
    """Everything needed to build a fresh ``Request`` (requests are mutable, one per run)."""

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int | None = 16
    priority: int = 0
    arrival_time: float = 0.0
    eos: tuple[int, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def params(self) -> SamplingParams:
        return SamplingParams(
            temperature=0.0,
            max_tokens=self.max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            stop_token_ids=list(self.stop_token_ids),
        )

    def make(self) -> Request:
        return Request(
            self.request_id,
            list(self.prompt),
            self.params(),
            eos_token_ids=self.eos,
            arrival_time=self.arrival_time,
            priority=self.priority,
        )


def reference_output(spec: Spec, max_model_len: int = 1 << 30) -> tuple[list[int], str]:
    """The tokens and finish reason of ``spec`` run alone with unlimited resources."""
    params = spec.params()
    tokens = list(spec.prompt)
    output: list[int] = []
    room = max(1, max_model_len - len(spec.prompt))
    limit = room if spec.max_tokens is None else min(spec.max_tokens, room)
    while True:
        token = next_token(tokens)
        tokens.append(token)
        output.append(token)
        if len(output) >= params.min_tokens:
            if not spec.ignore_eos and token in spec.eos:
                return output, "stop"
            if token in spec.stop_token_ids:
                return output, "stop"
        if len(output) >= limit:
            return output, "length"


def make_scheduler(
    num_blocks: int = 1024,
    block_size: int = 16,
    enable_prefix_caching: bool = False,
    **config: object,
) -> Scheduler:
    kv_cache = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
    return Scheduler(SchedulerConfig(**config), kv_cache)  # type: ignore[arg-type]


def run_specs(
    scheduler: Scheduler,
    specs: Iterable[Spec],
    arrive_at: Mapping[str, int] | None = None,
    **kwargs: object,
) -> DriveResult:
    """Drive ``specs`` through ``scheduler``; each arrives at ``arrive_at[id]`` (default 0)."""
    arrive_at = arrive_at or {}
    arrivals: dict[int, list[Request]] = {}
    for spec in specs:
        arrivals.setdefault(arrive_at.get(spec.request_id, 0), []).append(spec.make())
    return drive(scheduler, arrivals=arrivals, **kwargs)  # type: ignore[arg-type]


def assert_matches_reference(
    result: DriveResult, specs: Iterable[Spec], max_model_len: int = 1 << 30
) -> None:
    for spec in specs:
        if spec.request_id in result.aborted:
            continue
        tokens, reason = reference_output(spec, max_model_len)
        assert result.outputs.get(spec.request_id) == tokens, (
            f"{spec.request_id}: output differs from running alone"
        )
        assert result.finish_reasons.get(spec.request_id) == reason, spec.request_id
