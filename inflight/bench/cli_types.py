"""argparse types for the command lines' numbers: a bad value is a usage error naming
its option (``argument --threads: must be an integer >= 1, got 0``), raised before any
model loads, never a traceback or a failure deep inside a run."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def int_at_least(low: int) -> Callable[[str], int]:
    """The type of an integer option that must be ``>= low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    return parse


def ints_at_least(low: int) -> Callable[[str], tuple[int, ...]]:
    """The type of a comma-separated list of integers, each ``>= low``, at least one."""
    one = int_at_least(low)

    def parse(text: str) -> tuple[int, ...]:
        values = tuple(one(v.strip()) for v in text.split(",") if v.strip())
        if not values:
            raise argparse.ArgumentTypeError(f"needs at least one integer >= {low}, got {text!r}")
        return values

    return parse


def seconds(allow_zero: bool = False) -> Callable[[str], float]:
    """The type of a duration option: finite seconds, ``> 0`` (or ``>= 0``)."""
    bound = ">= 0" if allow_zero else "> 0"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be seconds {bound}, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"must be finite seconds {bound}, got {text}")
        return value

    return parse


def fraction(text: str) -> float:
    """The type of a ratio option: a number in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text}")
    return value


def port(text: str) -> int:
    """The type of a TCP port option: 0-65535 (0: the OS picks a free one, to listen)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a port is 0-65535, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535, got {value}")
    return value
