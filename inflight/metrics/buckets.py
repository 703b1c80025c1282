"""Histogram bucket edges, the same as vLLM's V1 ``PrometheusStatLogger`` exports.

A dashboard built for vLLM reads ``*_bucket{le=...}`` series; with the same edges its
quantile queries and heatmaps read ours the same way. Token-count histograms use a
1-2-5 series that stops at the context length, computed as vLLM computes it.
"""

from __future__ import annotations

# fmt: off
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
# Inter-token latency, and both time-per-output-token histograms.
ITL_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
# End-to-end, queue, inference, prefill and decode time of a request.
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)
ITERATION_TOKENS_BUCKETS: tuple[float, ...] = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
)
N_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 20)
# Preemptions of one request (vLLM 0.32): the first bucket also holds the never preempted.
PREEMPTIONS_BUCKETS: tuple[float, ...] = (1, 2, 3, 4, 5, 10, 20)
# fmt: on


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to and including ``max_value``.

    >>> build_1_2_5_buckets(100)
    (1, 2, 5, 10, 20, 50, 100)
    """
    edges: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            edge = mantissa * scale
            if edge > max_value:
                return tuple(edges)
            edges.append(edge)
        scale *= 10
