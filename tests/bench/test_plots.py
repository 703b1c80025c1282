"""``inflight plot``: non-empty PNGs whose pixels differ between static and continuous."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.image import imread

from inflight.bench.plots import EMPTY, IDLE, PICTURES, timeline_grid
from inflight.engine.step_trace import ScheduledEntry, StepRecord
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
    assert grid.shape == (3, 3)
    assert grid[1, 1] == IDLE and (grid[2] == EMPTY).all()
    assert grid[1, 0] != grid[1, 2]  # a new request in the slot gets the other shade
