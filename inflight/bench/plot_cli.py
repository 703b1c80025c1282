"""``inflight plot``: placeholder until the schedule pictures land."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    del subparsers  # not available yet
