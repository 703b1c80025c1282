"""``inflight serve``: placeholder until the OpenAI-compatible server lands."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    del subparsers  # not available yet
