"""Latency against arrival rate, from ``inflight bench serve`` result files.

::

    python -m inflight.bench.rate_plot RESULT.json [RESULT.json ...] -o latency_vs_rate.png

Each result is one engine at one rate. The engine is the first word of the result's
``label`` (``serve_compare.sh`` labels them ``ENGINE NAME``); the rate is its
``workload_rate`` (``--rate``), else a numeric ``request_rate``, else the number that ends
the label (``online-0.5``). Prints a Markdown table (TTFT and TPOT P50 / P99, goodput:
requests per second that met both ``--ttft-slo`` and ``--tpot-slo``, as in vLLM's
``--goodput``) and draws P99 TTFT and P99 TPOT against the rate, one line per engine.
Results of vLLM's own client (``bench/peers/vllm_serve_client.py``) are read too, as
"ENGINE [vllm client]", with the goodput that client computed.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RatePoint:
    engine: str
    rate: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    good: int  # requests that met both latency targets
    total: int
    duration_s: float

    @property
    def goodput(self) -> float:
        """Requests per second that met both targets."""
        return self.good / self.duration_s if self.duration_s else 0.0


def load_point(path: Path, ttft_slo_s: float, tpot_slo_s: float) -> RatePoint:
    """One result file as a point; ValueError when its rate cannot be told."""
    data: dict[str, Any] = json.loads(path.read_text())
    label = str(data.get("label") or path.stem)
    rate = data.get("workload_rate")
    if rate is None and isinstance(data.get("request_rate"), int | float):
        rate = data["request_rate"]
    if rate is None:
        match = re.search(r"(\d+(?:\.\d+)?)$", label)
        if match is None:
            raise ValueError(f"{path}: no workload_rate, request_rate or rate ending the label")
        rate = float(match.group(1))
    engine = label.split()[0]
    if "requests" not in data and "request_goodput" in data:
        # vLLM's own client (`vllm bench serve`, see bench/peers/vllm_serve_client.py): no
        # per-request records; its goodput was computed with the targets it was given.
        duration = float(data["duration"])
        return RatePoint(
            engine=f"{engine} [vllm client]", rate=float(rate),
            ttft_p50_ms=data["median_ttft_ms"], ttft_p99_ms=data["p99_ttft_ms"],
            tpot_p50_ms=data["median_tpot_ms"], tpot_p99_ms=data["p99_tpot_ms"],
            good=round((data["request_goodput"] or 0.0) * duration),
            total=int(data["completed"]) + int(data.get("failed") or 0), duration_s=duration,
        )
    requests = data.get("requests", [])
    good = sum(
        1 for r in requests
        if r.get("ok") and r["ttft"] <= ttft_slo_s and (r.get("tpot") or 0.0) <= tpot_slo_s
    )
    return RatePoint(
        engine=engine, rate=float(rate),
        ttft_p50_ms=data["median_ttft_ms"], ttft_p99_ms=data["p99_ttft_ms"],
        tpot_p50_ms=data["median_tpot_ms"], tpot_p99_ms=data["p99_tpot_ms"],
        good=good, total=len(requests), duration_s=data["duration_s"],
    )


def format_table(points: list[RatePoint]) -> str:
    rows = [
        "| rate (req/s) | engine | TTFT P50 | TTFT P99 | TPOT P50 | TPOT P99 | goodput |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for p in sorted(points, key=lambda p: (p.rate, p.engine)):
        rows.append(
            f"| {p.rate:g} | {p.engine} | {p.ttft_p50_ms:.0f} ms | {p.ttft_p99_ms:.0f} ms | "
            f"{p.tpot_p50_ms:.1f} ms | {p.tpot_p99_ms:.1f} ms | "
            f"{p.goodput:.2f} req/s ({p.good}/{p.total}) |"
        )
    return "\n".join(rows)


def plot(points: list[RatePoint], path: Path, ttft_slo_s: float, tpot_slo_s: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_engine: dict[str, list[RatePoint]] = defaultdict(list)
    for p in points:
        by_engine[p.engine].append(p)
    fig, (ttft_ax, tpot_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for engine, series in sorted(by_engine.items()):
        series.sort(key=lambda p: p.rate)
        rates = [p.rate for p in series]
        ttft_ax.plot(rates, [p.ttft_p99_ms / 1e3 for p in series], marker="o", label=engine)
        tpot_ax.plot(rates, [p.tpot_p99_ms for p in series], marker="o", label=engine)
    ttft_ax.axhline(ttft_slo_s, color="grey", linestyle="--", linewidth=1, label="target")
    tpot_ax.axhline(tpot_slo_s * 1e3, color="grey", linestyle="--", linewidth=1, label="target")
    for ax, title, unit in ((ttft_ax, "P99 TTFT", "s"), (tpot_ax, "P99 TPOT", "ms")):
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel(f"{title} ({unit})")
        ax.set_yscale("log")
        ax.set_title(f"{title} against load")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m inflight.bench.rate_plot",
        description="Latency against arrival rate from 'inflight bench serve' result files.",
    )
    parser.add_argument("results", nargs="+", type=Path, metavar="RESULT.json")
    parser.add_argument("-o", "--output", type=Path, default=Path("latency_vs_rate.png"))
    parser.add_argument("--ttft-slo", type=float, default=2.0, help="seconds (default: 2)")
    parser.add_argument("--tpot-slo", type=float, default=0.25, help="seconds (default: 0.25)")
    args = parser.parse_args(argv)
    try:
        points = [load_point(p, args.ttft_slo, args.tpot_slo) for p in args.results]
    except (OSError, ValueError, KeyError) as error:
        parser.error(str(error))
    print(format_table(points))
    print(f"wrote {plot(points, args.output, args.ttft_slo, args.tpot_slo)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
