"""What this CPU is (Linux ``/proc/cpuinfo``; elsewhere the platform's strings): read by
the kernel build (its cache key), the roofline report and the planner's cost model."""

from __future__ import annotations

import platform
from functools import cache
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def cpu_model_name(cpuinfo: Path = CPUINFO) -> str:
    """The first processor's model name, else the platform's processor string."""
    value = _first_field(cpuinfo, "model name")
    return value if value is not None else (platform.processor() or platform.machine())


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The first processor's feature flags (``avx512_bf16``, ``amx_bf16``, ...); empty
    where unknown."""
    value = _first_field(cpuinfo, "flags")
    return frozenset(value.split()) if value is not None else frozenset()


@cache
def _first_field(cpuinfo: Path, name: str) -> str | None:
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return None
