"""Placeholder until this benchmark lands."""

from __future__ import annotations

import argparse


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    del bench_subparsers  # not available yet
