"""Schedule pictures from step traces (matplotlib, PNG, no display needed).

This module owns the pictures; it reads only :class:`StepRecord` lists (and reports for
the throughput bars), never a live engine:

* ``timeline.png``: the source document's figure. One row per batch slot that ever held a
  request (256 slots serving 8 requests draw 8 rows; the axis keeps the slot numbers),
  one column per step; each cell is prefill, decode, idle (held by a request that did no
  work, i.e. a finished member of a static batch) or empty. Successive requests in the
  same slot alternate between two shades (the darker one: the slot was refilled), so
  refilling a slot is visible. Traces are stacked on a shared step axis, so the shorter
  schedule is visibly shorter.
* ``batch_kv.png``: batch size (requests that worked) and KV blocks in use per step.
* ``latency.png``: cumulative distributions (CDFs) of per-request time to first token and
  time per output token.
* ``throughput.png``: output tokens/s per run, when reports are given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: benchmarks run on headless machines

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator  # noqa: E402

from inflight.bench.report import BenchReport, latencies_from_trace  # noqa: E402
from inflight.engine.step_trace import StepRecord  # noqa: E402

# Cell codes of the timeline grid, and their colours (blue for generating and a pale,
# washed-out blue for idle, as in the source document; white for empty).
EMPTY, IDLE, PREFILL_A, PREFILL_B, DECODE_A, DECODE_B = range(6)
_COLOURS = ["#ffffff", "#c9d6e3", "#f28e2b", "#c45a00", "#4e79a7", "#2a4d75"]
REFILL_LABEL = "darker: the next request in the same slot"
_LEGEND = [
    Patch(facecolor=_COLOURS[PREFILL_A], label="prefill"),
    Patch(facecolor=_COLOURS[DECODE_A], label="decode"),
    Patch(facecolor=_COLOURS[DECODE_B], label=REFILL_LABEL),
    Patch(facecolor=_COLOURS[IDLE], label="idle (held, finished)"),
    Patch(facecolor=_COLOURS[EMPTY], edgecolor="#999999", label="empty"),
]
MAX_LABELLED_ROWS = 16  # beyond this, the slot axis labels a few rows only
PICTURES = ("timeline.png", "batch_kv.png", "latency.png")
# Line styles per trace, so identical schedules (static inflight and transformers) stay
# visible on top of each other.
_STYLES = [
    dict(linestyle="-", linewidth=2.2),
    dict(linestyle="--", linewidth=1.6),
    dict(linestyle=":", linewidth=1.6),
    dict(linestyle="-.", linewidth=1.4),
]


@dataclass(frozen=True, slots=True)
class LabelledTrace:
    label: str
    records: list[StepRecord]


def timeline_grid(records: Sequence[StepRecord]) -> np.ndarray:
    """``[slots, num_steps]`` cell codes (see EMPTY..DECODE_B), one row per slot up to the
    highest that ever held a request: the slots after it are empty throughout, and a
    trace of max_num_seqs=1e9 must not allocate a billion rows."""
    num_slots = max(
        [0, *(e.slot + 1 for r in records for e in r.entries),
         *(slot + 1 for r in records for slot in r.idle_slots)]
    )
    grid = np.full((num_slots, len(records)), EMPTY, dtype=np.int8)
    owner: list[str | None] = [None] * num_slots
    shade = [1] * num_slots  # flips when a new request takes the slot
    for step, record in enumerate(records):
        for e in record.entries:
            if owner[e.slot] != e.request_id:
                owner[e.slot], shade[e.slot] = e.request_id, 1 - shade[e.slot]
            base = PREFILL_A if e.kind == "prefill" else DECODE_A
            grid[e.slot, step] = base + shade[e.slot]
        for slot in record.idle_slots:
            grid[slot, step] = IDLE
    return grid


def used_slots(grid: np.ndarray) -> np.ndarray:
    """Indices of the slots that ever held a request (any cell not empty), in order."""
    return np.flatnonzero((grid != EMPTY).any(axis=1))


def timeline_figure(traces: Sequence[LabelledTrace]) -> Figure:
    """The timeline: per trace, one row per used slot (labelled with its slot number)."""
    grids = [timeline_grid(t.records) for t in traces]
    rows = [used_slots(g) for g in grids]
    heights = [max(2, len(r)) for r in rows]
    num_steps = max(len(t.records) for t in traces)
    fig, axes = plt.subplots(
        len(traces),
        1,
        sharex=True,
        squeeze=False,
        figsize=(11, 1.3 + sum(min(h, 32) * 0.16 + 0.7 for h in heights)),
        gridspec_kw={"height_ratios": [min(h, 32) + 3 for h in heights]},
    )
    cmap = ListedColormap(_COLOURS)
    for ax, trace, full, slots in zip(axes[:, 0], traces, grids, rows, strict=True):
        grid = full[slots]
        ax.imshow(
            grid,
            aspect="auto",
            interpolation="nearest",
            cmap=cmap,
            vmin=0,
            vmax=len(_COLOURS) - 1,
            extent=(0, grid.shape[1], grid.shape[0], 0),
        )
        ax.set_xlim(0, num_steps)
        # a margin, so the first and last rows are not hidden under the frame
        ax.set_ylim(grid.shape[0] + 0.3, -0.3)
        _label_slots(ax, slots)
        ax.set_ylabel("batch slot")
        work = int(np.isin(full, (PREFILL_A, PREFILL_B, DECODE_A, DECODE_B)).sum())
        idle = int((full == IDLE).sum())
        num_slots = max([full.shape[0], *(r.num_slots for r in trace.records)])
        size = max(num_slots * full.shape[1], 1)
        ax.set_title(
            f"{trace.label}: {full.shape[1]} steps, {len(slots)} of {num_slots} slots "
            f"used; slot-steps working {work / size:.0%}, idle {idle / size:.0%}, "
            f"empty {1 - (work + idle) / size:.0%}",
            fontsize=10,
            loc="left",
        )
    axes[-1, 0].set_xlabel("engine step")
    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.legend(handles=_LEGEND, loc="upper right", ncol=5, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def _label_slots(ax: plt.Axes, slots: np.ndarray) -> None:
    """Row i is slot ``slots[i]``: label the rows with slot numbers, every row if few."""
    every = max(1, -(-len(slots) // MAX_LABELLED_ROWS))
    positions = np.arange(0, len(slots), every) + 0.5
    ax.yaxis.set_major_locator(FixedLocator(positions))
    ax.yaxis.set_major_formatter(
        FuncFormatter(lambda y, _: str(slots[int(y)]) if 0 <= y < len(slots) else "")
    )


def plot_timeline(traces: Sequence[LabelledTrace], path: str | Path) -> Path:
    return _save(timeline_figure(traces), path)


def plot_batch_kv(traces: Sequence[LabelledTrace], path: str | Path) -> Path:
    return _save(batch_kv_figure(traces), path)


def batch_kv_figure(traces: Sequence[LabelledTrace]) -> Figure:
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(11, 6))
    for i, trace in enumerate(traces):
        style = _STYLES[i % len(_STYLES)]
        steps = np.arange(len(trace.records))
        top.step(
            steps,
            [r.batch_size for r in trace.records],
            where="post",
            label=trace.label,
            color=f"C{i}",
            **style,
        )
        total = max((r.kv_blocks_total for r in trace.records), default=0)
        if total:  # transformers' cache is not paged: nothing to draw
            bottom.step(
                steps,
                [r.kv_blocks_used for r in trace.records],
                where="post",
                label=f"{trace.label} (of {total})",
                color=f"C{i}",
                **style,
            )
    top.set_ylabel("requests working")
    top.set_title("batch size per step", fontsize=10, loc="left")
    top.legend(fontsize=9)
    bottom.set_ylabel("KV blocks in use")
    bottom.set_xlabel("engine step")
    bottom.set_title("KV cache blocks in use per step", fontsize=10, loc="left")
    if bottom.get_legend_handles_labels()[0]:
        bottom.legend(fontsize=9)
    for ax in (top, bottom):  # counts of requests, blocks and steps: whole numbers, from 0
        ax.set_ylim(0, max(1.0, ax.get_ylim()[1]))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    return fig


def plot_latency(traces: Sequence[LabelledTrace], path: str | Path) -> Path:
    return _save(latency_figure(traces), path)


def latency_figure(traces: Sequence[LabelledTrace]) -> Figure:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, trace in enumerate(traces):
        style = {"color": f"C{i}", **_STYLES[i % len(_STYLES)]}
        latencies = latencies_from_trace(trace.records)
        _ecdf(left, [x.ttft_s for x in latencies], trace.label, style)
        _ecdf(
            right, [x.tpot_s * 1e3 for x in latencies if x.tpot_s is not None], trace.label, style
        )
    left.set_xlabel("time to first token (s)")
    left.set_title("TTFT, cumulative (CDF)", fontsize=10, loc="left")
    right.set_xlabel("time per output token (ms)")
    right.set_title("TPOT, cumulative (CDF)", fontsize=10, loc="left")
    for ax in (left, right):
        ax.set_ylabel("share of requests at or below x")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9)
    fig.suptitle(
        "cumulative distribution of per-request latency "
        "(offline: all requests arrive at the first step)",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def plot_throughput(reports: Sequence[BenchReport], path: str | Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 0.9 + 0.6 * len(reports)))
    labels = [r.label for r in reports]
    values = [r.output_tokens_per_s for r in reports]
    bars = ax.barh(
        labels,
        values,
        color=["#4e79a7" if r.batching == "continuous" else "#c9d6e3" for r in reports],
        edgecolor="#2a4d75",
    )
    ax.bar_label(bars, [f"{v:.1f}" for v in values], padding=3, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("output tokens/s")
    ax.set_xlim(0, max(values) * 1.2)
    ax.set_title(f"workload {reports[0].workload}", fontsize=10, loc="left")
    fig.tight_layout()
    return _save(fig, path)


def draw_all(
    traces: Sequence[LabelledTrace], out_dir: str | Path, reports: Sequence[BenchReport] = ()
) -> list[Path]:
    """Every picture for these traces (and reports) into ``out_dir``; returns the paths."""
    traces = [t for t in traces if t.records]
    if not traces:
        raise ValueError("the step trace is empty: nothing to draw")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [
        plot_timeline(traces, out / "timeline.png"),
        plot_batch_kv(traces, out / "batch_kv.png"),
        plot_latency(traces, out / "latency.png"),
    ]
    if reports:
        paths.append(plot_throughput(reports, out / "throughput.png"))
    return paths


def _ecdf(ax: plt.Axes, values: list[float], label: str, style: dict) -> None:
    if values:
        ordered = np.sort(values)
        ax.step(
            np.concatenate(([0.0], ordered)),
            np.arange(len(ordered) + 1) / len(ordered),
            where="post",
            label=label,
            **style,
        )


def _save(fig: plt.Figure, path: str | Path) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
