"""Sweeps: one simulation per value of a load or engine option, a table and a picture.

``--sweep request_rate=1,2,4,8`` re-times the workload's arrivals (the ``online``
workload is regenerated at each rate, which keeps its token ids and scales its arrival
times; any other workload gets Poisson arrivals at that rate); ``--sweep
max_num_seqs=8,16,32`` (or any engine option the simulator takes) changes the engine.
The knee is the first swept value whose P99 TTFT exceeds the ``--ttft-slo`` target.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inflight.bench import workloads
from inflight.bench.workloads import Workload, WorkloadRequest
from inflight.planner.cost_model import CostModel
from inflight.planner.simulator import simulate

RATE_KEY = "request_rate"
# Engine options a sweep may vary (the simulator's keyword options) and their types.
ENGINE_KEYS: dict[str, type] = {
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "num_kv_blocks": int,
    "kv_cache_memory_bytes": int,
    "block_size": int,
    "max_model_len": int,
    "long_prefill_token_threshold": int,
    "max_long_partial_prefills": int,
}
MS = 1000.0


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """How to build the workload, so that a rate sweep can rebuild it at each rate."""

    spec: str
    num_prompts: int | None = None
    repeat: int = 1
    seed: int = 0

    def build(self, rate: float | None = None) -> Workload:
        if self.spec == "online":
            return workloads.resolve("online", rate).head(self.num_prompts).repeat(self.repeat)
        base = workloads.resolve(self.spec).head(self.num_prompts).repeat(self.repeat)
        return base if rate is None else poisson_arrivals(base, rate, self.seed)


def poisson_arrivals(workload: Workload, rate: float, seed: int = 0) -> Workload:
    """The same requests with Poisson arrivals at ``rate`` req/s, the first at time 0."""
    workloads.check_rate(rate)
    rng = random.Random(seed)
    t, out = 0.0, []
    for r in workload.requests:
        out.append(WorkloadRequest(r.id, r.prompt_token_ids, r.max_tokens, t))
        t += rng.expovariate(rate)
    return Workload(f"{workload.name}@{rate:g}", out)


def parse_sweep(text: str) -> tuple[str, list[float]]:
    """``"request_rate=1,2,4"`` -> ("request_rate", [1.0, 2.0, 4.0])."""
    key, sep, values = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not values.strip():
        raise ValueError(f"--sweep wants KEY=V1,V2,..., got {text!r}")
    if key != RATE_KEY and key not in ENGINE_KEYS:
        raise ValueError(f"cannot sweep {key!r}; use {RATE_KEY} or one of {sorted(ENGINE_KEYS)}")
    try:
        parsed = [float(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--sweep {key} wants numbers, got {values!r}") from None
    low = 0.0 if key in ENGINE_KEYS else math.ulp(0.0)  # engine options may be 0 (off)
    if not parsed or not all(math.isfinite(v) and v >= low for v in parsed):
        kind = "numbers >= 0" if key in ENGINE_KEYS else "positive numbers"
        raise ValueError(f"--sweep {key} wants finite {kind}, got {values!r}")
    cast = ENGINE_KEYS.get(key, float)
    if cast is int and any(v != int(v) for v in parsed):
        raise ValueError(f"--sweep {key} wants whole numbers, got {values!r}")
    return key, sorted(cast(v) for v in parsed)


@dataclass(frozen=True, slots=True)
class SweepPoint:
    value: float
    batching: str
    summary: dict[str, Any]  # SimResult.serve_summary()
    note: str | None = None  # SimResult.refusal_note()

    @property
    def p99_ttft_s(self) -> float:
        return self.summary["p99_ttft_ms"] / MS


def run_sweep(
    spec: WorkloadSpec, key: str, values: Sequence[float], cost: CostModel,
    options: dict[str, Any], modes: Sequence[str], rate: float | None = None,
) -> list[SweepPoint]:
    points = []
    for mode in modes:
        for value in values:
            run_options = {**options, "batching": mode}
            point_rate = rate
            if key == RATE_KEY:
                point_rate = float(value)
            else:
                run_options[key] = value
            result = simulate(spec.build(point_rate), cost, **run_options)
            points.append(
                SweepPoint(value, mode, result.serve_summary(), result.refusal_note())
            )
    return points


def knee(points: Sequence[SweepPoint], slo_s: float, batching: str) -> SweepPoint | None:
    """The first point (in swept order) of ``batching`` whose P99 TTFT breaks the target."""
    return next((p for p in points if p.batching == batching and p.p99_ttft_s > slo_s), None)


_COLUMNS = [
    ("req/s", "request_throughput", 1.0, "{:.3f}"),
    ("out tok/s", "output_throughput", 1.0, "{:.1f}"),
    ("TTFT p50 s", "median_ttft_ms", 1 / MS, "{:.3f}"),
    ("TTFT p99 s", "p99_ttft_ms", 1 / MS, "{:.3f}"),
    ("TPOT p50 ms", "median_tpot_ms", 1.0, "{:.1f}"),
    ("TPOT p99 ms", "p99_tpot_ms", 1.0, "{:.1f}"),
    ("ITL p99 ms", "p99_itl_ms", 1.0, "{:.1f}"),
    ("E2E p99 s", "p99_e2el_ms", 1 / MS, "{:.2f}"),
    ("preempt", "num_preemptions", 1, "{}"),
    ("KV peak", "kv_usage_peak", 1.0, "{:.0%}"),
]


def format_sweep_table(points: Sequence[SweepPoint], key: str, slo_s: float | None) -> str:
    header = ["batching", key, *[c[0] for c in _COLUMNS]]
    if slo_s is not None:
        header.append(f"P99 TTFT <= {slo_s:g}s")
    rows = [header]
    for p in points:
        row = [p.batching, f"{p.value:g}"]
        row += [fmt.format(p.summary[name] * scale) for _, name, scale, fmt in _COLUMNS]
        if slo_s is not None:
            row.append("ok" if p.p99_ttft_s <= slo_s else "BROKEN")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def describe_knees(points: Sequence[SweepPoint], key: str, slo_s: float) -> list[str]:
    lines = []
    for mode in dict.fromkeys(p.batching for p in points):
        ours = [p for p in points if p.batching == mode]
        broken = knee(ours, slo_s, mode)
        if broken is None:
            lines.append(f"{mode}: P99 TTFT stays within {slo_s:g} s at every {key} swept")
            continue
        fine = [p for p in ours if p.value < broken.value and p.p99_ttft_s <= slo_s]
        last_ok = f"{fine[-1].value:g}" if fine else "none of the values swept"
        lines.append(
            f"{mode}: knee at {key}={broken.value:g} (P99 TTFT {broken.p99_ttft_s:.2f} s > "
            f"{slo_s:g} s); highest value within the target: {last_ok}"
        )
    return lines


def plot_sweep(
    points: Sequence[SweepPoint], key: str, slo_s: float | None, path: str | Path,
    title: str = "",
) -> Path:
    """TTFT and TPOT percentiles against the swept value; the SLO and knees marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ttft, ax_tpot) = plt.subplots(1, 2, figsize=(11, 4.2))
    colours = {"continuous": "#4e79a7", "static": "#e15759"}
    for mode in dict.fromkeys(p.batching for p in points):
        ours = [p for p in points if p.batching == mode]
        xs = [p.value for p in ours]
        colour = colours.get(mode, "#59a14f")
        for ax, stat, scale in ((ax_ttft, "ttft", 1 / MS), (ax_tpot, "tpot", 1.0)):
            ax.plot(xs, [p.summary[f"p99_{stat}_ms"] * scale for p in ours], "o-",
                    color=colour, label=f"{mode} P99")
            ax.plot(xs, [p.summary[f"median_{stat}_ms"] * scale for p in ours], "s--",
                    color=colour, alpha=0.7, label=f"{mode} P50")
        if slo_s is not None and (broken := knee(ours, slo_s, mode)) is not None:
            ax_ttft.axvline(broken.value, color=colour, linestyle=":", linewidth=1.5)
            left_half = broken.value <= (min(xs) + max(xs)) / 2
            ax_ttft.annotate(
                f"knee ({mode})\n{key}={broken.value:g}", (broken.value, broken.p99_ttft_s),
                textcoords="offset points", xytext=(6, 8) if left_half else (-6, 8),
                ha="left" if left_half else "right", fontsize=8, color=colour,
            )
    if slo_s is not None:
        ax_ttft.axhline(slo_s, color="#333333", linestyle="--", linewidth=1,
                        label=f"P99 TTFT target {slo_s:g} s")
    ax_ttft.set_yscale("log")
    ax_ttft.set_ylabel("time to first token (s)")
    ax_tpot.set_ylabel("time per output token (ms)")
    for ax in (ax_ttft, ax_tpot):
        ax.set_xlabel(key.replace("_", " ") + (" (req/s)" if key == RATE_KEY else ""))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or f"simulated latency vs {key}")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
