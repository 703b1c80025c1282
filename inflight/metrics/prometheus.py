"""Prometheus exposition of the engine's statistics, named in vLLM's style (``inflight:``).

Each server builds its own :class:`PrometheusMetrics` on a private ``CollectorRegistry``,
so two servers (or two tests) in one process never share or collide on metrics.

* Gauges and ``*_total`` counters are read at scrape time from the engine's latest
  :class:`EngineStats` snapshot (a custom collector), so the engine thread never touches
  prometheus objects per step.
* Histograms (TTFT, TPOT, end-to-end latency) are observed once per finished request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from inflight.metrics.stats import EngineStats, FinishedRequestStats

PREFIX = "inflight:"

# Bucket edges as in vLLM, so dashboards built for it read ours the same way.
# fmt: off
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)
# fmt: on


class _EngineStatsCollector(Collector):
    """Gauges and counters built from the engine snapshot at each scrape."""

    def __init__(self, read_stats: Callable[[], EngineStats], model_name: str) -> None:
        self._read_stats = read_stats
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._read_stats()
        labels = ["model_name"]
        values = [self._model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        yield gauge(
            "num_requests_running", "Requests in the running batch.", stats.num_requests_running
        )
        yield gauge(
            "num_requests_waiting", "Requests waiting to be scheduled.", stats.num_requests_waiting
        )
        yield gauge(
            "kv_cache_usage_perc",
            "Fraction of KV cache blocks in use (1 = full).",
            stats.kv_cache_usage,
        )
        yield gauge("num_kv_blocks_used", "KV cache blocks in use.", stats.num_kv_blocks_used)
        yield gauge(
            "num_kv_blocks_total", "KV cache blocks in the pool.", stats.num_kv_blocks_total
        )
        yield counter(
            "num_preemptions",
            "Preemptions (running request evicted, recomputed later).",
            stats.num_preemptions_total,
        )
        yield counter("prompt_tokens", "Prompt tokens prefilled.", stats.prompt_tokens_total)
        yield counter("generation_tokens", "Tokens generated.", stats.generation_tokens_total)
        yield counter("engine_steps", "Engine iterations run.", stats.num_steps_total)


class PrometheusMetrics:
    """All of one server's metrics; pass it to the async engine as a stat observer."""

    def __init__(self, read_stats: Callable[[], EngineStats], model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineStatsCollector(read_stats, model_name))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            family = Histogram(
                PREFIX + name,
                doc,
                labelnames=["model_name"],
                registry=self.registry,
                buckets=buckets,
            )
            return family.labels(model_name)

        self._ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self._tpot = histogram(
            "time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            TPOT_BUCKETS,
        )
        self._e2e = histogram(
            "e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS
        )
        self._success = Counter(
            PREFIX + "request_success",
            "Finished requests, by finish reason.",
            labelnames=["model_name", "finished_reason"],
            registry=self.registry,
        )
        self._model_name = model_name
        for reason in ("stop", "length", "abort", "error"):
            # Present from the start, so a scrape before any request shows zeros.
            self._success.labels(model_name, reason)

    def on_request_finished(self, stats: FinishedRequestStats) -> None:
        self._success.labels(self._model_name, stats.finish_reason).inc()
        self._e2e.observe(stats.e2e_latency)
        if stats.time_to_first_token is not None:
            self._ttft.observe(stats.time_to_first_token)
        if stats.time_per_output_token is not None:
            self._tpot.observe(stats.time_per_output_token)

    def render(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)
