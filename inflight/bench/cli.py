"""``inflight bench ...`` and ``inflight plot``: registration only, the work lives elsewhere."""

from __future__ import annotations

import argparse
import importlib

# each module exposes register(bench_subparsers)
BENCH_MODULES = [
    "inflight.bench.throughput",  # inflight bench throughput
    "inflight.bench.serve",  # inflight bench serve
    "inflight.bench.workload_cli",  # inflight bench workload
]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="benchmarks: throughput (offline), serve (online), workload (write one)"
    )
    bench_subparsers = parser.add_subparsers(dest="bench_command", required=True)
    for name in BENCH_MODULES:
        importlib.import_module(name).register(bench_subparsers)
