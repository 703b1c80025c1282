"""Serving statistics: what the async engine measures, and its Prometheus exposition.

``stats`` is pure Python (records the engine thread publishes); ``prometheus`` turns them
into vLLM's metric families under an ``inflight:`` prefix, on a private registry per server.
"""

from inflight.metrics.stats import (
    EngineStats,
    FinishedRequestStats,
    PrefixCacheStats,
    StatObserver,
    StatsRecorder,
    StepStats,
)

__all__ = [
    "EngineStats",
    "FinishedRequestStats",
    "PrefixCacheStats",
    "StatObserver",
    "StatsRecorder",
    "StepStats",
]
