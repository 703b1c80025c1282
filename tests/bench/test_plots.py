"""``inflight plot``: non-empty PNGs whose pixels differ between static and continuous."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.image import imread

from inflight.bench.plots import (
    EMPTY,
    IDLE,
    PICTURES,
    REFILL_LABEL,
    LabelledTrace,
    batch_kv_figure,
    latency_figure,
    timeline_figure,
    timeline_grid,
)
from inflight.engine.step_trace import ScheduledEntry, StepRecord, StepTrace
from inflight.entrypoints.cli import main


def test_plot_command_draws_different_pictures_per_policy(bench_run, tmp_path: Path, capsys):
    pictures = {}
    for policy in ("static", "continuous"):
        trace = bench_run.out_dir / f"trace_inflight_{policy}.jsonl"
        out = tmp_path / policy
        assert main(["plot", str(trace), "--out-dir", str(out)]) == 0
        printed = capsys.readouterr().out.split()
        for name in PICTURES:
            assert str(out / name) in printed and (out / name).stat().st_size > 1000
        pictures[policy] = {name: imread(out / name) for name in PICTURES}
    for name in PICTURES:
        static, continuous = pictures["static"][name], pictures["continuous"][name]
        assert static.std() > 0  # not a blank canvas
        assert static.shape != continuous.shape or not np.array_equal(static, continuous)


def test_plot_command_draws_several_traces_side_by_side(bench_run, tmp_path: Path) -> None:
    traces = sorted(str(p) for p in bench_run.out_dir.glob("trace_*.jsonl"))
    assert (
        main(
            [
                "plot",
                *traces,
                "--label",
                "a",
                "--label",
                "b",
                "--label",
                "c",
                "--out-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert all((tmp_path / name).stat().st_size > 1000 for name in PICTURES)


def test_timeline_grid_marks_idle_and_empty_slots() -> None:
    def record(step: int, entries: list[ScheduledEntry], idle: list[int]) -> StepRecord:
        return StepRecord(step, step * 0.1, 0.1, entries, [], [], len(entries), 0, 1, 8, 3, idle)

    records = [
        record(0, [ScheduledEntry("a", 0, 4, "prefill"), ScheduledEntry("b", 1, 4, "prefill")], []),
        record(1, [ScheduledEntry("a", 0, 1, "decode")], [1]),
        record(2, [ScheduledEntry("c", 1, 3, "prefill")], []),
    ]
    grid = timeline_grid(records)
    assert grid.shape == (2, 3)  # slot 2 of 3 never held a request: no row for it
    assert grid[1, 1] == IDLE and grid[0, 2] == EMPTY
    assert grid[1, 0] != grid[1, 2]  # a new request in the slot gets the other shade


def sparse_trace() -> list[StepRecord]:
    """256 slots, three used (0, 3 and 100); slot 3 is refilled by a second request."""

    def record(step: int, entries: list[ScheduledEntry]) -> StepRecord:
        return StepRecord(step, step * 0.1, 0.1, entries, [], [], len(entries), 0, 1, 64, 256, [])

    return [
        record(0, [ScheduledEntry("a", 0, 4, "prefill"), ScheduledEntry("b", 3, 4, "prefill")]),
        record(1, [ScheduledEntry("a", 0, 1, "decode"), ScheduledEntry("b", 3, 1, "decode")]),
        record(2, [ScheduledEntry("c", 3, 4, "prefill"), ScheduledEntry("d", 100, 2, "prefill")]),
        record(3, [ScheduledEntry("c", 3, 1, "decode")]),
    ]


def test_timeline_draws_only_used_slots_labelled_with_their_numbers() -> None:
    fig = timeline_figure([LabelledTrace("sparse", sparse_trace())])
    fig.canvas.draw()
    ax = fig.axes[0]
    (image,) = ax.images
    grid = image.get_array()
    assert grid.shape == (3, 4)  # rows: the 3 slots that held a request, not 256
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "3", "100"]
    bottom, top = ax.get_ylim()
    assert top < 0 and bottom > grid.shape[0]  # row 0 (and the last) inside the frame
    assert grid[1, 0] != grid[1, 2]  # slot 3's second request: the other (darker) shade
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert REFILL_LABEL in labels and "idle (held, finished)" in labels
    assert "3 of 256 slots used" in ax.get_title(loc="left")


def test_count_axes_have_integer_ticks(bench_run) -> None:
    records = StepTrace.read_jsonl(bench_run.out_dir / "trace_inflight_continuous.jsonl")
    small = [LabelledTrace("s", sparse_trace())]  # 1-2 requests: default ticks go by 0.25
    figures = [batch_kv_figure([LabelledTrace("continuous", records)]), batch_kv_figure(small)]
    for fig in [*figures, timeline_figure(small)]:
        fig.canvas.draw()
        for ax in fig.axes:
            ticks = list(ax.get_xticks())
            if ax.get_ylabel() in ("requests working", "KV blocks in use"):
                ticks += list(ax.get_yticks())
            assert ticks and all(float(t).is_integer() for t in ticks), (ax.get_ylabel(), ticks)


def test_latency_chart_says_it_is_cumulative(bench_run) -> None:
    records = StepTrace.read_jsonl(bench_run.out_dir / "trace_inflight_static.jsonl")
    fig = latency_figure([LabelledTrace("static", records)])
    assert "cumulative" in fig.get_suptitle()
    for ax in fig.axes:
        assert "cumulative" in ax.get_title(loc="left") and "at or below" in ax.get_ylabel()
