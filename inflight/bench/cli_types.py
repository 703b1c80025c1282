"""argparse types for the command lines' numbers: a bad value is a usage error naming
its option (``argument --threads: must be an integer >= 1, got 0``), raised before any
model loads, never a traceback or a failure deep inside a run."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T", int, float)


def _number(convert: Callable[[str], T], ok: Callable[[T], bool], wanted: str) -> Callable[[str], T]:
    """An argparse type: ``convert(text)`` when it parses and ``ok``; else a usage error
    "``wanted``, got ...". One shape for every numeric option below."""

    def parse(text: str) -> T:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{wanted}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{wanted}, got {text}")
        return value

    return parse


def int_at_least(low: int) -> Callable[[str], int]:
    """The type of an integer option that must be ``>= low``."""
    return _number(int, lambda v: v >= low, f"must be an integer >= {low}")


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
    low_ok = (lambda v: v >= 0) if allow_zero else (lambda v: v > 0)
    bound = ">= 0" if allow_zero else "> 0"
    return _number(float, lambda v: math.isfinite(v) and low_ok(v),
                   f"must be finite seconds {bound}")


fraction = _number(float, lambda v: 0 <= v < 1, "must be a number in [0, 1)")
fraction.__doc__ = "The type of a ratio option: a number in [0, 1)."

port = _number(int, lambda v: 0 <= v <= 65535, "a port is 0-65535")
port.__doc__ = "The type of a TCP port option: 0-65535 (0: the OS picks a free one, to listen)."
