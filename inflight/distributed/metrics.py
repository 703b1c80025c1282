"""Prometheus metrics of every replica in one exposition, each sample labelled ``replica``.

Each replica's latest :class:`EngineStats` (polled by the client) is rendered by the same
collector a single-engine server uses, with ``engine`` set to the replica index (vLLM's
label for data-parallel engines) and a ``replica`` label added; the samples of one family
from all replicas are merged under one ``# HELP``/``# TYPE``, so ``sum by (model_name)``
aggregates across replicas. The router's own families come beside them:

* ``inflight:replica_up{replica}``: 1 while the replica is in rotation, else 0;
* ``inflight:replica_requests_routed{replica}``: requests routed to it (a counter);
* ``inflight:replica_outstanding_tokens{replica}``: the router's load for it;
* ``inflight:replica_restarts{replica}``: times it came back after dying.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from inflight.metrics.prometheus import PREFIX, PrometheusMetrics
from inflight.metrics.stats import EngineStats


@dataclass(frozen=True, slots=True)
class ReplicaSnapshot:
    """One replica as the client last saw it."""

    replica: int
    alive: bool
    stats: EngineStats | None  # None until its first answer
    num_requests_routed: int
    outstanding_tokens: int
    num_restarts: int


class _ReplicasCollector(Collector):
    def __init__(self, read: Callable[[], Sequence[ReplicaSnapshot]], model_name: str) -> None:
        self._read = read
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        snapshots = self._read()
        yield from self._router_families(snapshots)
        merged: dict[str, Metric] = {}
        for snapshot in snapshots:
            if snapshot.stats is None:
                continue
            for family in _engine_families(snapshot.stats, self._model_name):
                target = merged.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type)
                )
                target.samples.extend(_relabel(s, snapshot.replica) for s in family.samples)
        yield from merged.values()

    def _router_families(self, snapshots: Sequence[ReplicaSnapshot]) -> Iterator[Metric]:
        labels = ["model_name", "replica"]
        up = GaugeMetricFamily(PREFIX + "replica_up", "1 while the replica is in rotation.", labels=labels)
        routed = CounterMetricFamily(
            PREFIX + "replica_requests_routed", "Requests routed to the replica.", labels=labels
        )
        load = GaugeMetricFamily(
            PREFIX + "replica_outstanding_tokens",
            "Prompt and output tokens the router counts as still owed by the replica.",
            labels=labels,
        )
        restarts = CounterMetricFamily(
            PREFIX + "replica_restarts", "Times the replica came back after dying.", labels=labels
        )
        for s in snapshots:
            values = [self._model_name, str(s.replica)]
            up.add_metric(values, 1.0 if s.alive else 0.0)
            routed.add_metric(values, s.num_requests_routed)
            load.add_metric(values, s.outstanding_tokens)
            restarts.add_metric(values, s.num_restarts)
        yield from (up, routed, load, restarts)


def _engine_families(stats: EngineStats, model_name: str) -> Iterable[Metric]:
    """The single-engine families for one replica's snapshot."""
    return PrometheusMetrics(lambda: stats, model_name).registry.collect()


def _relabel(sample: Sample, replica: int) -> Sample:
    labels = dict(sample.labels)
    if "engine" in labels:
        labels["engine"] = str(replica)
    labels["replica"] = str(replica)
    return sample._replace(labels=labels)


class DataParallelMetrics:
    """What ``/metrics`` renders for a data-parallel server."""

    def __init__(self, read: Callable[[], Sequence[ReplicaSnapshot]], model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_ReplicasCollector(read, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)
