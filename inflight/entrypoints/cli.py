"""The ``inflight`` command: generate, serve, bench, plot.

Each subcommand lives in its own module with ``register(subparsers)``; heavy imports
(torch, the model) happen only when a subcommand runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand modules, each exposing register(subparsers) that sets a ``handler`` default
SUBCOMMAND_MODULES = [
    "inflight.entrypoints.generate_cli",  # inflight generate
    "inflight.entrypoints.serve_cli",  # inflight serve
    "inflight.bench.cli",  # inflight bench {throughput,serve}
    "inflight.bench.plot_cli",  # inflight plot
    "inflight.planner.cli",  # inflight calibrate, inflight simulate
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inflight",
        description="LLM inference with continuous batching over a paged KV cache",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except (ValueError, FileNotFoundError) as error:
        print(f"inflight: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
