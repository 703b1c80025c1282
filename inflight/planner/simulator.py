"""Replay a workload through the real scheduler on a virtual clock.

The simulator drives the very same :class:`Scheduler` and :class:`KVCacheManager` as the
engine (imported, not copied) and replaces only the model: a fake runner samples one
token per request that asks for one, and each step lasts what the :class:`CostModel`
says. So batching, chunked prefill, prefix caching, preemption and the KV accounting are
exactly the engine's; only the step times are predicted.

    clock = 0
    loop: add every request with arrival_s <= clock -> schedule() -> fake runner
          -> update_from_output() -> clock += cost(step) -> stamp tokens at the clock

Requests run as in the benchmarks: greedy with EOS ignored, so each produces exactly its
workload's ``max_tokens`` tokens. A step's sampled tokens are stamped at the step's end,
as the engine stamps them; an idle engine jumps to the next arrival.

The step trace it keeps has the engine's format (:class:`StepRecord`), so the reports,
slot-step accounting and pictures of ``inflight bench`` read simulated runs unchanged.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import Any

from inflight.bench.report import BenchReport, RequestLatency, request_latency
from inflight.bench.workloads import Workload, WorkloadRequest
from inflight.config import SchedulerConfig, make_engine_config
from inflight.core.interface import ModelRunnerOutput, RequestUpdate, SchedulerOutput
from inflight.core.kv_cache_manager import KVCacheManager, cdiv
from inflight.core.request import Request
from inflight.core.scheduler import Scheduler
from inflight.engine.step_trace import StepRecord, record_step
from inflight.planner.cost_model import CostModel, StepFeatures
from inflight.sampling_params import InvalidRequestError, SamplingParams

# Fake output token ids stay in this range (any vocabulary of the default model's size).
_TOKEN_LOW, _TOKEN_SPAN = 1000, 48000
# Latest arrival the virtual clock can take: a double still resolves 0.2 us there (beyond
# it token times round away; at 1e300 s a step's duration vanished entirely).
MAX_ARRIVAL_S = 1e9


@dataclass(frozen=True, slots=True)
class SimConfig:
    """What the simulated engine is: the scheduler's config and the KV cache's size."""

    scheduler: SchedulerConfig
    num_kv_blocks: int
    block_size: int
    enable_prefix_caching: bool

    def describe(self) -> dict[str, Any]:
        s = self.scheduler
        return {
            "batching": s.batching,
            "max_num_seqs": s.max_num_seqs,
            "max_num_batched_tokens": s.max_num_batched_tokens,
            "max_model_len": s.max_model_len,
            "enable_chunked_prefill": s.enable_chunked_prefill,
            "scheduling_policy": s.scheduling_policy,
            "long_prefill_token_threshold": s.long_prefill_token_threshold,
            "max_long_partial_prefills": s.max_long_partial_prefills,
            "block_size": self.block_size,
            "num_kv_blocks": self.num_kv_blocks,
            "enable_prefix_caching": self.enable_prefix_caching,
        }


def make_sim_config(cost: CostModel, **options: Any) -> SimConfig:
    """Engine keyword options (as ``LLM(...)`` takes them) -> the simulated engine.

    Defaults are the engine's (``make_engine_config``); ``max_model_len`` defaults to the
    calibrated model's, and without ``num_kv_blocks`` the KV memory budget is turned
    into blocks with the calibrated model's KV bytes per token, capped (as the engine
    does) at what ``max_num_seqs`` full-length requests could ever use.
    """
    options = {k: v for k, v in options.items() if v is not None}
    options.setdefault("max_model_len", cost.max_model_len)
    if options["max_model_len"] > cost.max_model_len:  # the engine refuses it too
        raise ValueError(
            f"max_model_len={options['max_model_len']} exceeds the calibrated model's "
            f"context length ({cost.max_model_len})"
        )
    config = make_engine_config(None, **options)
    cache, scheduler = config.cache, config.scheduler
    num_blocks = cache.num_kv_blocks
    if num_blocks is None:
        affordable = cache.kv_cache_memory_bytes // (cost.kv_bytes_per_token * cache.block_size)
        useful = scheduler.max_num_seqs * cdiv(scheduler.max_model_len, cache.block_size) + 1
        if affordable < 1:
            raise ValueError(
                f"kv_cache_memory_bytes ({cache.kv_cache_memory_bytes}) is too small for even "
                f"one KV block of block_size={cache.block_size} tokens; raise "
                "kv_cache_memory_bytes or lower block_size"
            )
        num_blocks = min(affordable, useful)
    return SimConfig(scheduler, num_blocks, cache.block_size, cache.enable_prefix_caching)


@dataclass
class SimRequest:
    """One simulated request's life on the virtual clock (seconds)."""

    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    token_times: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # Why the engine refused it (as the server answers 400), e.g. a prompt over the
    # context length; empty when it was served.
    error: str = ""

    @property
    def latency(self) -> RequestLatency:
        return request_latency(
            self.request_id, self.num_prompt_tokens, len(self.token_times), self.arrival_s,
            self.token_times[0], self.token_times[-1],
        )


@dataclass
class SimResult:
    """A simulated run: its step trace (engine format) and every request's timings."""

    label: str
    workload: Workload
    config: SimConfig
    cost: CostModel
    records: list[StepRecord]
    requests: list[SimRequest]
    num_preemptions: int
    sim_wall_s: float  # real seconds the simulation took

    @property
    def served(self) -> list[SimRequest]:
        return [r for r in self.requests if not r.error]

    @property
    def refused(self) -> list[SimRequest]:
        """Requests the engine refused when they were added (the server's 400s)."""
        return [r for r in self.requests if r.error]

    def refusal_note(self) -> str | None:
        """One line on the refused requests, if any."""
        refused = self.refused
        if not refused:
            return None
        return (f"{len(refused)} of {len(self.requests)} requests refused, as the server "
                f"would answer them (400); the first: {refused[0].error}")

    @property
    def duration_s(self) -> float:
        """Virtual seconds from the start (time 0) to the last request's end."""
        return max((r.token_times[-1] for r in self.served), default=0.0)

    @property
    def busy_s(self) -> float:
        """Virtual seconds the engine spent in steps."""
        return sum(r.duration_s for r in self.records)

    @property
    def speedup(self) -> float:
        """Simulated engine-busy time per real second of simulation."""
        return self.busy_s / self.sim_wall_s if self.sim_wall_s > 0 else float("inf")

    @property
    def kv_usage_peak(self) -> float:
        return max((r.kv_blocks_used / r.kv_blocks_total for r in self.records), default=0.0)

    @property
    def kv_usage_mean(self) -> float:
        if not self.records:
            return 0.0
        return sum(r.kv_blocks_used / r.kv_blocks_total for r in self.records) / len(self.records)

    def serve_summary(self) -> dict[str, Any]:
        """What ``inflight bench serve`` reports (same keys), plus the engine's view."""
        summary = serve_summary(self.requests, self.duration_s)
        summary.update(
            num_steps=len(self.records),
            num_preemptions=self.num_preemptions,
            kv_usage_peak=self.kv_usage_peak,
            kv_usage_mean=self.kv_usage_mean,
            num_kv_blocks=self.config.num_kv_blocks,
            prefix_cache_hit_tokens=sum(r.num_cached_tokens for r in self.requests),
        )
        return summary

    def bench_report(self) -> BenchReport:
        """The ``inflight bench throughput`` report of this run (virtual wall time)."""
        from inflight.bench.engine_run import summarise

        report = summarise(
            f"simulated {self.config.scheduler.batching}", "inflight (simulated)",
            self.config.scheduler.batching, self.workload, self.duration_s, self.records,
            self.config.scheduler.max_num_seqs, self.num_preemptions,
            [r.latency for r in self.served], {**self.config.describe(), "cost": self.cost.source},
        )
        report.peak_rss_mib = 0.0  # nothing was loaded
        return report


def serve_summary(requests: list[SimRequest], duration_s: float) -> dict[str, Any]:
    """``inflight bench serve``'s summary (its own function) of requests' token times."""
    from inflight.bench.serve import RequestResult, summarize

    results = [
        RequestResult(
            ok=True, prompt_tokens=r.num_prompt_tokens, output_tokens=len(r.token_times),
            ttft=r.token_times[0] - r.arrival_s, latency=r.token_times[-1] - r.arrival_s,
            itl=[b - a for a, b in zip(r.token_times, r.token_times[1:], strict=False)],
        )
        if not r.error else RequestResult(ok=False, error=r.error)
        for r in requests
    ]
    return summarize(results, duration_s)


def fake_token(request_id: str, index: int) -> int:
    """A deterministic output token, distinct across requests, so the blocks of generated
    tokens are never shared by two requests' prefix-cache hashes (as with real models on
    different prompts) yet are the same whenever a request is recomputed."""
    return _TOKEN_LOW + zlib.crc32(f"{request_id}:{index}".encode()) % _TOKEN_SPAN


class Simulator:
    """The engine's step loop with the model replaced by a cost model."""

    def __init__(self, config: SimConfig, cost: CostModel) -> None:
        self.config = config
        self.cost = cost
        self.kv_cache = KVCacheManager(
            config.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_cache)
        self.clock = 0.0
        self.records: list[StepRecord] = []
        self._requests: dict[str, SimRequest] = {}

    def run(self, workload: Workload, label: str | None = None) -> SimResult:
        started = time.perf_counter()
        pending = sorted(workload.requests, key=lambda r: r.arrival_s)  # stable: FCFS ties
        if pending and pending[-1].arrival_s > MAX_ARRIVAL_S:
            raise ValueError(
                f"{workload.name}: the last request arrives at {pending[-1].arrival_s:.3g} s, "
                f"beyond {MAX_ARRIVAL_S:g} s (about 31 years), where the virtual clock cannot "
                "time tokens to the microsecond; use a higher request rate or earlier arrivals"
            )
        sim_requests = []
        next_index = 0
        while next_index < len(pending) or self.scheduler.has_unfinished_requests():
            while next_index < len(pending) and pending[next_index].arrival_s <= self.clock:
                sim_requests.append(self._add(pending[next_index]))
                next_index += 1
            if not self.scheduler.has_unfinished_requests():
                if next_index == len(pending):
                    break  # the last arrivals were refused
                self.clock = pending[next_index].arrival_s  # idle until the next arrival
                continue
            if not self.step():
                if next_index == len(pending):
                    raise RuntimeError("the scheduler made no progress with requests waiting")
                self.clock = max(self.clock, pending[next_index].arrival_s)
        if sim_requests and all(r.error for r in sim_requests):
            raise ValueError(f"no request of {workload.name} can be served: {sim_requests[0].error}")
        return SimResult(
            label or f"simulated {self.config.scheduler.batching}", workload, self.config,
            self.cost, self.records, sim_requests, self.scheduler.num_preemptions,
            time.perf_counter() - started,
        )

    def _add(self, item: WorkloadRequest) -> SimRequest:
        request_id = str(item.id)
        params = SamplingParams(temperature=0.0, max_tokens=item.max_tokens, ignore_eos=True)
        request = Request(
            request_id=request_id, prompt_token_ids=list(item.prompt_token_ids),
            sampling_params=params, arrival_time=item.arrival_s,
            max_model_len=self.config.scheduler.max_model_len,
        )
        sim = SimRequest(request_id, item.arrival_s, len(item.prompt_token_ids))
        try:
            self.scheduler.add_request(request)
        except InvalidRequestError as error:  # refused, as the server answers it (400)
            sim.error = f"request {request_id}: {error}"
            return sim
        self._requests[request_id] = sim
        return sim

    def step(self) -> bool:
        """One engine step on the virtual clock; False when nothing could be scheduled."""
        output = self.scheduler.schedule()
        if output.is_empty:
            return False
        started = self.clock
        duration = self.cost.step_time(StepFeatures.of_scheduler_output(output))
        sampled = {
            s.request_id: fake_token(s.request_id, s.start_position + s.num_tokens)
            for s in output.scheduled
            if s.sample
        }
        updates = self.scheduler.update_from_output(output, ModelRunnerOutput(sampled))
        self.clock = started + duration
        for update in updates:
            sim = self._requests[update.request_id]
            sim.token_times.extend([self.clock] * len(update.new_token_ids))
        for s in output.scheduled:
            if s.num_cached_tokens:
                self._requests[s.request_id].num_cached_tokens = s.num_cached_tokens
        for request_id in output.preempted_request_ids:
            self._requests[request_id].num_preemptions += 1
        self._record(output, updates, started, duration)
        return True

    def _record(
        self, output: SchedulerOutput, updates: list[RequestUpdate], started: float,
        duration: float,
    ) -> None:
        """The engine's step record (the same builder as ``LLMEngine``'s trace)."""
        self.records.append(record_step(self.scheduler, output, updates, started, duration))


def simulate(
    workload: Workload, cost: CostModel, label: str | None = None, **options: Any
) -> SimResult:
    """Run ``workload`` through a fresh simulated engine built from engine ``options``."""
    return Simulator(make_sim_config(cost, **options), cost).run(workload, label)
