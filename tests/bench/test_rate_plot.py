"""rate_plot reads bench serve results: the rate, the engine and goodput as defined."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inflight.bench.rate_plot import format_table, load_point, main


def write_result(path: Path, label: str, requests: list[dict], **extra: object) -> Path:
    record = {
        "label": label, "duration_s": 10.0, "median_ttft_ms": 100.0, "p99_ttft_ms": 900.0,
        "median_tpot_ms": 50.0, "p99_tpot_ms": 300.0, "requests": requests, **extra,
    }
    path.write_text(json.dumps(record))
    return path


REQUESTS = [
    {"ok": True, "ttft": 0.5, "tpot": 0.1},   # meets both targets
    {"ok": True, "ttft": 2.5, "tpot": 0.1},   # TTFT too long
    {"ok": True, "ttft": 0.5, "tpot": 0.3},   # TPOT too long
    {"ok": False, "ttft": 0.1, "tpot": 0.1},  # failed
    {"ok": True, "ttft": 1.9, "tpot": None},  # one token: no TPOT, meets TTFT
]


def test_goodput_counts_requests_meeting_both_targets(tmp_path: Path) -> None:
    path = write_result(tmp_path / "a.json", "inflight online-2", REQUESTS, workload_rate=2.0)
    point = load_point(path, ttft_slo_s=2.0, tpot_slo_s=0.25)
    assert (point.engine, point.rate, point.good, point.total) == ("inflight", 2.0, 2, 5)
    assert point.goodput == pytest.approx(0.2)


def test_rate_from_request_rate_then_label(tmp_path: Path) -> None:
    by_request_rate = write_result(tmp_path / "b.json", "vllm x", [], request_rate=1.5)
    assert load_point(by_request_rate, 2.0, 0.25).rate == 1.5
    by_label = write_result(tmp_path / "c.json", "vllm online-0.5", [], request_rate="workload")
    assert load_point(by_label, 2.0, 0.25).rate == 0.5
    unknown = write_result(tmp_path / "d.json", "vllm online", [], request_rate="workload")
    with pytest.raises(ValueError, match="rate"):
        load_point(unknown, 2.0, 0.25)


def test_table_sorted_by_rate_and_picture_written(tmp_path: Path) -> None:
    paths = [
        write_result(tmp_path / f"{e}{r}.json", f"{e} online-{r}", REQUESTS, workload_rate=r)
        for e in ("vllm", "inflight") for r in (4.0, 0.5)
    ]
    table = format_table([load_point(p, 2.0, 0.25) for p in paths])
    rows = [line.split("|")[1:3] for line in table.splitlines()[2:]]
    assert [(r.strip(), e.strip()) for r, e in rows] == [
        ("0.5", "inflight"), ("0.5", "vllm"), ("4", "inflight"), ("4", "vllm"),
    ]
    out = tmp_path / "plot.png"
    assert main([*map(str, paths), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_vllm_client_result_uses_its_own_goodput(tmp_path: Path) -> None:
    """vLLM's `vllm bench serve --save-result` file (its key names: duration, completed,
    failed, request_goodput in requests/s) has no per-request records."""
    path = tmp_path / "v.json"
    path.write_text(json.dumps({
        "label": "inflight-no-prefix online-1", "workload_rate": 1.0, "client": "vllm bench serve",
        "duration": 40.0, "completed": 39, "failed": 1, "request_goodput": 0.75,
        "median_ttft_ms": 300.0, "p99_ttft_ms": 1800.0, "median_tpot_ms": 60.0,
        "p99_tpot_ms": 120.0,
    }))
    point = load_point(path, ttft_slo_s=2.0, tpot_slo_s=0.25)
    assert point.engine == "inflight-no-prefix [vllm client]"
    assert (point.rate, point.good, point.total) == (1.0, 30, 40)
    assert point.goodput == pytest.approx(0.75)
    assert point.ttft_p99_ms == 1800.0
