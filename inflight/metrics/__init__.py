"""Serving statistics: what the async engine measures, and its Prometheus exposition.

``stats`` is pure Python (records the engine thread publishes); ``prometheus`` turns them
into ``inflight:*`` metrics on a private registry, one per server.
"""

from inflight.metrics.stats import EngineStats, FinishedRequestStats, StatObserver

__all__ = ["EngineStats", "FinishedRequestStats", "StatObserver"]
