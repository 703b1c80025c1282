"""Records the async engine publishes about itself (pure Python, no prometheus).

The engine thread owns the numbers: it fills one :class:`StepStats` per iteration and one
:class:`FinishedRequestStats` per ended request, folds both into its
:class:`StatsRecorder` (plain ints and lists, no lock: one writer), and after every
iteration replaces its :class:`EngineStats` snapshot wholesale. Readers on other threads
(the ``/metrics`` scrape) see either the old or the new record, never a half-updated one,
and the engine never waits on them. It also hands each :class:`FinishedRequestStats` to
every :class:`StatObserver`.

Accounting follows vLLM's V1 frontend (``IterationStats``), so the exported series mean
the same thing:

* a request's prompt tokens count once, in the step that produced its first token
  (recomputation after a preemption is not counted again), and so do those of them that
  came from the prefix cache (``prompt_tokens_cached``);
* ``iteration_tokens_total`` observes, once per step that produced tokens, that step's
  prompt tokens (as above) plus the tokens it generated;
* one inter-token latency per request per step after its first token;
* queue = first scheduled - arrival; prefill = first token - first scheduled;
  decode = last token - first token; inference = last token - first scheduled.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from types import MappingProxyType
from typing import Protocol

from inflight.metrics.buckets import (
    ITERATION_TOKENS_BUCKETS,
    ITL_BUCKETS,
    N_BUCKETS,
    PREEMPTIONS_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    build_1_2_5_buckets,
)

FINISH_REASONS = ("stop", "length", "abort", "error")


# ---------------------------------------------------------------------- histograms


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """A histogram at one instant, as Prometheus exposes it.

    ``cumulative_counts[i]`` observations were ``<= upper_bounds[i]``; ``count`` is the
    ``+Inf`` bucket.
    """

    upper_bounds: tuple[float, ...]
    cumulative_counts: tuple[int, ...]
    count: int
    sum: float


class Histogram:
    """Bucket counts filled by one thread; :meth:`snapshot` is cached until the next observe."""

    __slots__ = ("upper_bounds", "_counts", "_sum", "_snapshot")

    def __init__(self, upper_bounds: Sequence[float]) -> None:
        self.upper_bounds = tuple(float(edge) for edge in upper_bounds)
        self._counts = [0] * (len(self.upper_bounds) + 1)  # the last one: above every edge
        self._sum = 0.0
        self._snapshot: HistogramSnapshot | None = None

    def observe(self, value: float, count: int = 1) -> None:
        """Record ``count`` observations of ``value`` (``le`` edges are inclusive)."""
        self._counts[bisect_left(self.upper_bounds, value)] += count
        self._sum += value * count
        self._snapshot = None

    def snapshot(self) -> HistogramSnapshot:
        if self._snapshot is None:
            self._snapshot = HistogramSnapshot(
                upper_bounds=self.upper_bounds,
                cumulative_counts=tuple(accumulate(self._counts[:-1])),
                count=sum(self._counts),
                sum=self._sum,
            )
        return self._snapshot


def histogram_buckets(max_model_len: int) -> dict[str, tuple[float, ...]]:
    """Every histogram the engine fills (vLLM's names, no prefix) and its bucket edges.

    ``time_per_output_token_seconds`` is vLLM's pre-0.11 name of the inter-token latency
    (hidden there since, kept here for older dashboards): it observes the same values.
    """
    tokens = tuple(float(edge) for edge in build_1_2_5_buckets(max_model_len))
    return {
        "time_to_first_token_seconds": TTFT_BUCKETS,
        "inter_token_latency_seconds": ITL_BUCKETS,
        "time_per_output_token_seconds": ITL_BUCKETS,
        "request_time_per_output_token_seconds": ITL_BUCKETS,
        "e2e_request_latency_seconds": REQUEST_LATENCY_BUCKETS,
        "request_queue_time_seconds": REQUEST_LATENCY_BUCKETS,
        "request_inference_time_seconds": REQUEST_LATENCY_BUCKETS,
        "request_prefill_time_seconds": REQUEST_LATENCY_BUCKETS,
        "request_decode_time_seconds": REQUEST_LATENCY_BUCKETS,
        "request_prompt_tokens": tokens,
        "request_generation_tokens": tokens,
        "request_max_num_generation_tokens": tokens,
        "request_params_max_tokens": tokens,
        "request_params_n": N_BUCKETS,
        "iteration_tokens_total": ITERATION_TOKENS_BUCKETS,
        "request_num_preemptions": PREEMPTIONS_BUCKETS,
        "request_prefill_kv_computed_tokens": tokens,
    }


# ---------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Cumulative prefix-cache lookups, in tokens (vLLM's ``prefix_cache_queries/hits``).

    A frozen copy of the KV cache manager's counts (queried = tokens of admitted requests
    looked up, hits = tokens found cached), published after every step. Without prefix
    caching both stay 0.
    """

    queries: int = 0
    hits: int = 0


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's state after its latest iteration; ``*_total`` fields only grow."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    num_kv_blocks_used: int = 0
    num_kv_blocks_total: int = 0
    num_preemptions_total: int = 0
    prompt_tokens_total: int = 0
    prompt_tokens_cached_total: int = 0  # of prompt_tokens_total, read from the prefix cache
    generation_tokens_total: int = 0
    num_steps_total: int = 0
    # Waiting requests held back by a transient constraint (a grammar still compiling):
    # vLLM's "deferred" reason; the other waiting requests wait for capacity.
    num_requests_deferred: int = 0
    prefix_cache: PrefixCacheStats = PrefixCacheStats()
    # Finished requests by finish reason (every reason of FINISH_REASONS, zeros included).
    request_success: tuple[tuple[str, int], ...] = ()
    # vLLM histogram name (no prefix) -> its state; see histogram_buckets().
    histograms: Mapping[str, HistogramSnapshot] = field(
        default_factory=lambda: MappingProxyType({})
    )
    # vLLM's cache_config_info labels (CacheConfig field names -> str(value)), fixed.
    cache_config_info: tuple[tuple[str, str], ...] = ()
    # Requests refused at once because max_waiting_requests were waiting (backpressure).
    num_rejected_queue_full_total: int = 0
    # Requests aborted because they passed their deadline (request_timeout).
    num_request_timeouts_total: int = 0


@dataclass(frozen=True, slots=True)
class FinishedRequestStats:
    """One request's life, in seconds; ``finish_reason`` is stop, length, abort or error.

    Intervals a request never reached (never scheduled, no token) are 0.
    """

    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    e2e_latency: float
    time_to_first_token: float | None  # None when no token was produced
    time_per_output_token: float | None  # None with fewer than two output tokens
    queue_time: float = 0.0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    inference_time: float = 0.0
    max_tokens_param: int | None = None  # the output-token limit the request ran with
    n: int = 1
    num_cached_prompt_tokens: int = 0  # read from the prefix cache, not computed
    num_preemptions: int = 0


@dataclass(slots=True)
class StepStats:
    """What one engine step produced, gathered on the engine thread, recorded once."""

    time: float  # when the step's outputs were seen
    num_prompt_tokens: int = 0  # of requests whose first token came in this step
    num_cached_prompt_tokens: int = 0  # ... of them read from the prefix cache
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    # previous token time -> requests that got their next token now: the inter-token
    # gaps, grouped (a step's decodes mostly share their previous step).
    previous_token_times: dict[float, int] = field(default_factory=dict)

    def first_token(
        self, num_prompt_tokens: int, num_new_tokens: int, arrival: float, num_cached: int = 0
    ) -> None:
        self.num_prompt_tokens += num_prompt_tokens
        self.num_cached_prompt_tokens += num_cached
        self.num_generation_tokens += num_new_tokens
        self.time_to_first_tokens.append(self.time - arrival)

    def next_tokens(self, num_new_tokens: int, previous_token_time: float) -> None:
        self.num_generation_tokens += num_new_tokens
        times = self.previous_token_times
        times[previous_token_time] = times.get(previous_token_time, 0) + 1


class StatsRecorder:
    """Counters and histograms over the engine's life; engine thread only (no lock)."""

    def __init__(self, max_model_len: int) -> None:
        self.prompt_tokens_total = 0
        self.prompt_tokens_cached_total = 0
        self.generation_tokens_total = 0
        self._success = dict.fromkeys(FINISH_REASONS, 0)
        self._histograms = {
            name: Histogram(edges) for name, edges in histogram_buckets(max_model_len).items()
        }

    def record_step(self, step: StepStats) -> None:
        """Once per step that produced at least one token."""
        self.prompt_tokens_total += step.num_prompt_tokens
        self.prompt_tokens_cached_total += step.num_cached_prompt_tokens
        self.generation_tokens_total += step.num_generation_tokens
        hist = self._histograms
        hist["iteration_tokens_total"].observe(step.num_prompt_tokens + step.num_generation_tokens)
        for ttft in step.time_to_first_tokens:
            hist["time_to_first_token_seconds"].observe(ttft)
        for previous, count in step.previous_token_times.items():
            hist["inter_token_latency_seconds"].observe(step.time - previous, count)
            hist["time_per_output_token_seconds"].observe(step.time - previous, count)

    def record_finished(self, stats: FinishedRequestStats) -> None:
        self._success[stats.finish_reason] = self._success.get(stats.finish_reason, 0) + 1
        hist = self._histograms
        hist["e2e_request_latency_seconds"].observe(stats.e2e_latency)
        hist["request_queue_time_seconds"].observe(stats.queue_time)
        hist["request_prefill_time_seconds"].observe(stats.prefill_time)
        hist["request_decode_time_seconds"].observe(stats.decode_time)
        hist["request_inference_time_seconds"].observe(stats.inference_time)
        hist["request_prompt_tokens"].observe(stats.num_prompt_tokens)
        hist["request_generation_tokens"].observe(stats.num_output_tokens)
        # The first token is the prefill's; vLLM observes 0 below two tokens.
        decodes = stats.num_output_tokens - 1
        tpot = stats.decode_time / decodes if decodes > 0 else 0.0
        hist["request_time_per_output_token_seconds"].observe(tpot)
        # With n == 1 the longest of the request's sequences is the request itself.
        hist["request_max_num_generation_tokens"].observe(stats.num_output_tokens)
        hist["request_params_n"].observe(stats.n)
        if stats.max_tokens_param:
            hist["request_params_max_tokens"].observe(stats.max_tokens_param)
        hist["request_num_preemptions"].observe(stats.num_preemptions)
        hist["request_prefill_kv_computed_tokens"].observe(
            stats.num_prompt_tokens - stats.num_cached_prompt_tokens
        )

    @property
    def request_success(self) -> tuple[tuple[str, int], ...]:
        return tuple(self._success.items())

    def histogram_snapshots(self) -> Mapping[str, HistogramSnapshot]:
        return MappingProxyType({name: h.snapshot() for name, h in self._histograms.items()})


class StatObserver(Protocol):
    """Told about every finished request, on the engine thread: must be quick and thread-safe."""

    def on_request_finished(self, stats: FinishedRequestStats) -> None: ...
