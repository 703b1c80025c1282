"""Prometheus exposition of the engine's statistics: vLLM's V1 families, prefix ``inflight:``.

Every family vLLM's ``PrometheusStatLogger`` exports by default has the same name (after
``vllm:`` -> ``inflight:``), type, label names (``model_name``, ``engine``, plus
``finished_reason`` / ``sleep_state``) and bucket edges, so a dashboard built for vLLM
works after a find-and-replace of the prefix. ``docs/metrics.md`` lists them.

Each server builds its own :class:`PrometheusMetrics` on a private ``CollectorRegistry``,
so two servers (or two tests) in one process never share or collide on metrics. All
families, histograms included, are rendered at scrape time from the engine's latest
:class:`EngineStats` snapshot by one custom collector: the engine thread never touches a
prometheus object, and a scrape never makes it wait.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from inflight.metrics.stats import EngineStats, FinishedRequestStats, HistogramSnapshot

PREFIX = "inflight:"
ENGINE_INDEX = "0"  # one engine per server; vLLM labels each data-parallel engine
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")

HISTOGRAM_DOCS = {
    "time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "time_per_output_token_seconds": (
        "Histogram of time per output token in seconds. "
        "Same values as inter_token_latency_seconds (vLLM's name before 0.11)."
    ),
    "request_time_per_output_token_seconds": (
        "Histogram of time_per_output_token_seconds per request."
    ),
    "e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
    "request_inference_time_seconds": "Histogram of time spent in RUNNING phase for request.",
    "request_prefill_time_seconds": "Histogram of time spent in PREFILL phase for request.",
    "request_decode_time_seconds": "Histogram of time spent in DECODE phase for request.",
    "request_prompt_tokens": "Number of prefill tokens processed.",
    "request_generation_tokens": "Number of generation tokens processed.",
    "request_max_num_generation_tokens": (
        "Histogram of maximum number of requested generation tokens."
    ),
    "request_params_n": "Histogram of the n request parameter.",
    "request_params_max_tokens": "Histogram of the max_tokens request parameter.",
    "iteration_tokens_total": "Histogram of number of tokens per engine_step.",
    "request_num_preemptions": "Histogram of the number of times a request was preempted.",
    "request_prefill_kv_computed_tokens": (
        "Histogram of new KV tokens computed during prefill (excluding cached tokens)."
    ),
}
# vLLM 0.32's sources of prompt tokens and of prefix-cache hits; here only the local ones.
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_HIT_SOURCES = ("device", "host", "disk", "p2p", "external_unspecified")
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")


class _EngineStatsCollector(Collector):
    """Every family, built from the engine snapshot at each scrape."""

    def __init__(self, read_stats: Callable[[], EngineStats], model_name: str) -> None:
        self._read_stats = read_stats
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._read_stats()  # one snapshot: every family describes the same instant
        yield from self._gauges(stats)
        yield from self._counters(stats)
        yield self._request_success(stats)
        yield self._cache_config_info(stats)
        for name, snapshot in stats.histograms.items():
            yield self._histogram(name, snapshot)

    # ------------------------------------------------------------------ builders

    @property
    def _labels(self) -> tuple[list[str], list[str]]:
        return ["model_name", "engine"], [self._model_name, ENGINE_INDEX]

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        names, values = self._labels
        family = GaugeMetricFamily(PREFIX + name, doc, labels=names)
        family.add_metric(values, value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        names, values = self._labels
        family = CounterMetricFamily(PREFIX + name, doc, labels=names)
        family.add_metric(values, value)
        return family

    def _by_label(
        self, family: CounterMetricFamily | GaugeMetricFamily, label_values: dict[str, float]
    ) -> Metric:
        """One sample per value of the family's last label (after model_name, engine)."""
        _, values = self._labels
        for label, value in label_values.items():
            family.add_metric([*values, label], value)
        return family

    def _gauges(self, stats: EngineStats) -> Iterator[Metric]:
        names, values = self._labels
        yield self._gauge(
            "num_requests_running",
            "Number of requests in model execution batches.",
            stats.num_requests_running,
        )
        yield self._gauge(
            "num_requests_waiting",
            "Number of requests waiting to be processed.",
            stats.num_requests_waiting,
        )
        yield self._gauge(
            "kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            stats.kv_cache_usage,
        )
        yield self._by_label(
            GaugeMetricFamily(
                PREFIX + "num_requests_waiting_by_reason",
                "Number of waiting requests by reason. Reason labels: 'capacity' = waiting "
                "for scheduling capacity; 'deferred' = deferred by transient constraints "
                "(here: a grammar still compiling). Sum of all reasons equals "
                "inflight:num_requests_waiting.",
                labels=[*names, "reason"],
            ),
            {
                "capacity": stats.num_requests_waiting - stats.num_requests_deferred,
                "deferred": stats.num_requests_deferred,
            },
        )
        sleep = GaugeMetricFamily(
            PREFIX + "engine_sleep_state",
            "Engine sleep state; awake = 1 means engine is awake (inflight never sleeps).",
            labels=[*names, "sleep_state"],
        )
        for state in SLEEP_STATES:
            sleep.add_metric([*values, state], 1.0 if state == "awake" else 0.0)
        yield sleep
        # inflight's own, beside vLLM's.
        yield self._gauge("num_kv_blocks_used", "KV cache blocks in use.", stats.num_kv_blocks_used)
        yield self._gauge(
            "num_kv_blocks_total", "KV cache blocks in the pool.", stats.num_kv_blocks_total
        )

    def _counters(self, stats: EngineStats) -> Iterator[Metric]:
        yield self._counter(
            "prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            stats.prefix_cache.queries,
        )
        yield self._counter(
            "prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            stats.prefix_cache.hits,
        )
        # No KV connector and no multi-modal models: these are truly zero.
        for name, doc in (
            ("external_prefix_cache_queries", "External prefix cache queries (KV connector)."),
            ("external_prefix_cache_hits", "External prefix cache hits (KV connector)."),
            ("mm_cache_queries", "Multi-modal cache queries, in items."),
            ("mm_cache_hits", "Multi-modal cache hits, in items."),
        ):
            yield self._counter(name, doc, 0)
        yield self._counter(
            "num_preemptions",
            "Cumulative number of preemption from the engine.",
            stats.num_preemptions_total,
        )
        yield self._counter(
            "prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens_total
        )
        yield from self._prompt_token_sources(stats)
        yield self._counter(
            "generation_tokens",
            "Number of generation tokens processed.",
            stats.generation_tokens_total,
        )
        yield self._counter("engine_steps", "Engine iterations run.", stats.num_steps_total)
        yield self._request_rejected(stats)
        yield self._admission_rejections(stats)
        yield self._counter(
            "request_timeout",
            "Requests aborted because they did not finish within their request_timeout.",
            stats.num_request_timeouts_total,
        )

    def _prompt_token_sources(self, stats: EngineStats) -> Iterator[Metric]:
        """vLLM 0.32's split of the prompt tokens: computed here or read from the prefix
        cache (counted when the request's first token comes), and the cache hits by tier
        (counted at admission, as ``prefix_cache_hits``). No KV transfer, no offloading."""
        names, _ = self._labels
        cached = stats.prompt_tokens_cached_total
        yield self._counter(
            "prompt_tokens_cached", "Number of cached prompt tokens (local + external).", cached
        )
        yield self._by_label(
            CounterMetricFamily(
                PREFIX + "prompt_tokens_by_source", "Number of prompt tokens by source.",
                labels=[*names, "source"],
            ),
            dict.fromkeys(PROMPT_TOKEN_SOURCES, 0)
            | {"local_compute": stats.prompt_tokens_total - cached, "local_cache_hit": cached},
        )
        yield self._by_label(
            CounterMetricFamily(
                PREFIX + "prompt_tokens_cached_by_source",
                "Prefix-cache hit tokens by the cache tier that supplied them (here always "
                "device: the KV cache itself). Counted at admission; sums to "
                "inflight:prefix_cache_hits + inflight:external_prefix_cache_hits.",
                labels=[*names, "source"],
            ),
            dict.fromkeys(CACHE_HIT_SOURCES, 0) | {"device": stats.prefix_cache.hits},
        )

    def _admission_rejections(self, stats: EngineStats) -> Metric:
        """vLLM 0.32's name for what ``request_rejected`` counts: its frontend counter,
        labelled by model and reason only (no engine)."""
        family = CounterMetricFamily(
            PREFIX + "admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason "
            "(max_num_queued_reqs: max_waiting_requests were waiting).",
            labels=["model_name", "reason"],
        )
        for reason in ADMISSION_REASONS:
            rejected = stats.num_rejected_queue_full_total if reason == "max_num_queued_reqs" else 0
            family.add_metric([self._model_name, reason], rejected)
        return family

    def _request_rejected(self, stats: EngineStats) -> Metric:
        names, values = self._labels
        family = CounterMetricFamily(
            PREFIX + "request_rejected",
            "Requests refused at once by backpressure (reason queue_full: "
            "max_waiting_requests were waiting).",
            labels=[*names, "reason"],
        )
        family.add_metric([*values, "queue_full"], stats.num_rejected_queue_full_total)
        return family

    def _request_success(self, stats: EngineStats) -> Metric:
        names, values = self._labels
        family = CounterMetricFamily(
            PREFIX + "request_success",
            "Count of successfully processed requests.",
            labels=[*names, "finished_reason"],
        )
        for reason, count in stats.request_success:
            family.add_metric([*values, reason], count)
        return family

    def _cache_config_info(self, stats: EngineStats) -> Metric:
        # An info metric as vLLM writes it: a gauge fixed at 1, the config in its labels.
        info = dict(stats.cache_config_info, engine=ENGINE_INDEX)
        family = GaugeMetricFamily(
            PREFIX + "cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=list(info),
        )
        family.add_metric(list(info.values()), 1.0)
        return family

    def _histogram(self, name: str, snapshot: HistogramSnapshot) -> Metric:
        names, values = self._labels
        family = HistogramMetricFamily(PREFIX + name, HISTOGRAM_DOCS[name], labels=names)
        buckets = [
            (floatToGoString(edge), count)
            for edge, count in zip(snapshot.upper_bounds, snapshot.cumulative_counts, strict=True)
        ]
        buckets.append(("+Inf", snapshot.count))
        family.add_metric(values, buckets, sum_value=snapshot.sum)
        return family


class PrometheusMetrics:
    """All of one server's metrics, rendered from the engine's :class:`EngineStats`."""

    def __init__(self, read_stats: Callable[[], EngineStats], model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineStatsCollector(read_stats, model_name))

    def on_request_finished(self, stats: FinishedRequestStats) -> None:
        """Nothing to do: finished requests reach the snapshot. Kept so that code which
        registers this object as a stat observer keeps working."""

    def render(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)
