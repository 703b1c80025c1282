"""``inflight calibrate`` and ``inflight simulate`` end to end (tiny model where real)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inflight.entrypoints.cli import main
from inflight.planner.cost_model import CostModel


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Never read or write the user's own calibration."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_simulate_seed8_compare(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", "--workload", "seed8", "--compare", "--output-dir", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "simulated static: 850 of 4000 slot-steps did work; 78.8% were held idle" in out
    assert "Serving Benchmark Result" in out and "P99 TTFT (ms)" in out
    # Nothing was loaded: the memory row says "not measured", not 0 MiB.
    (rss,) = [line for line in out.splitlines() if line.startswith("peak RSS (MiB)")]
    assert rss.split()[-2:] == ["-", "-"], rss
    payload = json.loads((tmp_path / "simulation.json").read_text())
    steps = {r["label"]: r["serve"]["num_steps"] for r in payload["runs"]}
    assert steps == {"simulated static": 500, "simulated continuous": 500}
    assert (tmp_path / "timeline.png").stat().st_size > 0
    assert (tmp_path / "trace_simulated_static.jsonl").is_file()


def test_simulate_rate_sweep_marks_the_knee(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main([
        "simulate", "--workload", "online", "--num-prompts", "40", "--compare",
        "--sweep", "request_rate=0.25,1,4,16", "--ttft-slo", "1.0", "--output-dir", str(tmp_path),
    ])
    assert code == 0
    out = capsys.readouterr().out
    payload = json.loads((tmp_path / "sweep_request_rate.json").read_text())
    points = payload["points"]
    assert len(points) == 8 and {p["batching"] for p in points} == {"static", "continuous"}
    continuous = [p["p99_ttft_ms"] for p in points if p["batching"] == "continuous"]
    assert continuous == sorted(continuous)  # (static's need not be: see docs/planner.md)
    for mode in ("static", "continuous"):
        broken = [p["value"] for p in points if p["batching"] == mode and p["p99_ttft_ms"] > 1000]
        if broken:
            assert f"{mode}: knee at request_rate={broken[0]:g}" in out
    # static batching makes newcomers wait for whole batches: its TTFT breaks first
    static_p99 = [p["p99_ttft_ms"] for p in points if p["batching"] == "static"]
    continuous_p99 = [p["p99_ttft_ms"] for p in points if p["batching"] == "continuous"]
    assert static_p99[-1] > continuous_p99[-1]
    assert "BROKEN" in out
    assert (tmp_path / "sweep_request_rate.png").stat().st_size > 0


def test_simulate_engine_option_sweep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main([
        "simulate", "--workload", "mixed", "--num-prompts", "30",
        "--sweep", "max_num_seqs=1,4,16", "--output-dir", str(tmp_path), "--no-plots",
    ])
    assert code == 0
    points = json.loads((tmp_path / "sweep_max_num_seqs.json").read_text())["points"]
    duration = [p["duration_s"] for p in points]
    assert duration == sorted(duration, reverse=True)  # more slots, sooner done
    assert duration[0] > 2 * duration[-1]


def test_calibrate_from_trace_then_simulate_with_it(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.jsonl"
    code = main([
        "generate", "--model", str(tiny_llama_dir), "--dtype", "float32", "--max-tokens", "12",
        "--trace", str(trace), "--max-num-batched-tokens", "16",
        *[f"w{i} w{i + 1} w{i + 2} w{i + 3} w{i + 5}" * (i % 4 + 1) for i in range(3, 60, 3)],
    ])
    assert code == 0
    calibration = tmp_path / "calib.json"
    assert main(["calibrate", "--from-trace", str(trace), "--output", str(calibration)]) == 0
    out = capsys.readouterr().out
    assert "held-out steps" in out
    cost = CostModel.load(calibration)
    assert cost.held_out is not None and cost.source == f"trace {trace}"
    assert main(["simulate", "--workload", "seed8", "--cost", str(calibration), "--no-plots",
                 "--output-dir", str(tmp_path / "sim")]) == 0
    payload = json.loads((tmp_path / "sim" / "simulation.json").read_text())
    assert payload["cost_model"]["source"] == cost.source


def test_calibrate_sweep_on_the_tiny_model(tiny_llama_dir: Path, tmp_path: Path) -> None:
    output = tmp_path / "calibration.json"
    code = main([
        "calibrate", "--model", str(tiny_llama_dir), "--dtype", "float32",
        "--batch-sizes", "1,2,4", "--context-lens", "8,32", "--prefill-lens", "16,64",
        "--decode-steps", "3", "--output", str(output), "--trace-out", str(tmp_path / "t.jsonl"),
    ])
    assert code == 0
    cost = CostModel.load(output)
    # the tiny model's KV bytes per token: K and V x 2 layers x 2 KV heads x 16 dims x 4 bytes
    assert cost.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert cost.max_model_len == 512
    assert cost.held_out is not None and cost.num_fit_steps > 0
    records = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    batch_sizes = {len(r["entries"]) for r in records if r["entries"][0]["kind"] == "decode"}
    assert {1, 2, 4} <= batch_sizes


def test_validate_replays_really_and_in_simulation(tiny_llama_dir: Path, tmp_path: Path) -> None:
    workload = tmp_path / "w.jsonl"
    rows = [
        {"id": i, "prompt_token_ids": [10 + (7 * i + j) % 400 for j in range(8 + 9 * i)],
         "max_tokens": 4 + 3 * i, "arrival_s": 0.05 * i}
        for i in range(6)
    ]
    workload.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = main([
        "simulate", "--validate", "--workload", str(workload), "--model", str(tiny_llama_dir),
        "--dtype", "float32", "--max-num-seqs", "4", "--output-dir", str(tmp_path),
    ])
    assert code == 0
    payload = json.loads((tmp_path / "validation.json").read_text())
    (run,) = payload["runs"]
    measured, predicted = run["measured"], run["predicted"]
    assert measured["completed"] == predicted["completed"] == 6
    assert measured["total_output_tokens"] == predicted["total_output_tokens"] == sum(
        r["max_tokens"] for r in rows
    )
    assert {"median_ttft_ms", "p99_ttft_ms", "p99_tpot_ms", "p99_e2el_ms"} <= set(run["errors"])
    assert run["step_error"]["num_steps"] == measured["num_steps"] > 0
    assert len((tmp_path / "trace_real_1.jsonl").read_text().splitlines()) == measured["num_steps"]


def test_bad_cost_models_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A cost file with negative, zero or non-numeric costs, and a calibration for an
    impossible context length, are refused by name (exit 2), not simulated as nonsense
    (negative durations) or crashed on (division by zero, TypeError)."""
    out = ["--output-dir", str(tmp_path / "sim"), "--no-plots"]
    base = json.loads(json.dumps(CostModel(intercept_s=0.01).to_json()))
    for fields in ({"intercept_s": -1.0}, {"intercept_s": 0.0}, {"intercept_s": "fast"},
                   {"kv_bytes_per_token": 0}):
        cost = tmp_path / "cost.json"
        cost.write_text(json.dumps({**base, **fields}))
        assert main(["simulate", "--workload", "seed8", "--cost", str(cost), *out]) == 2
        err = capsys.readouterr().err
        assert f"inflight: error: {cost} is not a cost model" in err and next(iter(fields)) in err
    trace = tmp_path / "trace.jsonl"
    assert main(["simulate", "--workload", "seed8", *out]) == 0
    (tmp_path / "sim" / "trace_simulated_continuous.jsonl").rename(trace)
    capsys.readouterr()
    for length in ("0", "1"):  # (-1 is vLLM's "auto": the default)
        code = main(["calibrate", "--from-trace", str(trace), "--max-model-len", length,
                     "--output", str(tmp_path / "c.json")])
        assert code == 2
        assert "max_model_len must be a whole number >= 2" in capsys.readouterr().err
    assert not (tmp_path / "c.json").exists()


def test_unwritable_outputs_are_refused_before_the_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An --output that is a folder, or an --output-dir that is a file or cannot be
    created, is one line naming the option, said before minutes of calibration or a
    whole sweep, not after."""
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("the work ran before the output was checked")

    monkeypatch.setattr("inflight.planner.calibrate.calibrate", must_not_run)
    monkeypatch.setattr("inflight.planner.sweep.run_sweep", must_not_run)
    monkeypatch.setattr("inflight.planner.simulator.simulate", must_not_run)
    cases = [
        (["calibrate", "--output", str(tmp_path)], f"--output {tmp_path} is a folder, not a file"),
        (["calibrate", "--output", f"{a_file}/c.json"], "is a file, not a folder"),
        (["calibrate", "--output", str(tmp_path / "c.json"), "--trace-out", str(tmp_path)],
         "--trace-out"),
        (["simulate", "--workload", "seed8", "--output-dir", str(a_file)],
         f"--output-dir {a_file} is a file, not a folder"),
        (["simulate", "--workload", "seed8", "--sweep", "max_num_seqs=1,2",
          "--output-dir", f"{a_file}/sub"], "cannot be created"),
        (["plot", str(a_file), "--out-dir", str(a_file)], "--out-dir"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        (line,) = captured.err.strip().splitlines()[-1:]
        assert line.startswith("inflight: error: ") and message in line, (argv, line)
        assert "Traceback" not in captured.err and "req/s" not in captured.out


def test_simulate_names_the_requests_the_engine_would_refuse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One prompt over the context among others: a note, its request failed, the rest
    predicted; exit 0. The same prompt alone: one error line, exit 2."""
    rows = [{"id": 0, "prompt_token_ids": [7] * 9000, "max_tokens": 3, "arrival_s": 0},
            {"id": 1, "prompt_token_ids": [8] * 100, "max_tokens": 30, "arrival_s": 0}]
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = ["--output-dir", str(tmp_path / "sim"), "--no-plots"]
    assert main(["simulate", "--workload", str(workload), *out]) == 0
    captured = capsys.readouterr()
    assert "note: simulated continuous: 1 of 2 requests refused" in captured.err
    assert "request 0: This model's maximum context length is 8192 tokens" in captured.err
    serve = json.loads((tmp_path / "sim" / "simulation.json").read_text())["runs"][0]["serve"]
    assert (serve["completed"], serve["failed"], serve["total_output_tokens"]) == (1, 1, 30)
    workload.write_text(json.dumps(rows[0]) + "\n")
    assert main(["simulate", "--workload", str(workload), *out]) == 2
    assert "inflight: error: no request of w can be served" in capsys.readouterr().err


def test_the_default_output_folder_is_ignored_by_git() -> None:
    """The README's simulate commands write planner-results/W in the checkout, as bench
    writes bench-results/: neither shows up as untracked files."""
    import shutil
    import subprocess

    root = Path(__file__).resolve().parents[2]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    probe = "planner-results/seed8/simulation.json"
    assert subprocess.run(["git", "check-ignore", "-q", probe], cwd=root).returncode == 0


def test_simulate_reads_sizes_as_serve_does(tmp_path: Path) -> None:
    """--kv-cache-memory-bytes 1G, --max-model-len 4k / auto and --max-num-batched-tokens
    2K are read as 'inflight serve' reads them (were 'invalid int value')."""
    argv = ["simulate", "--workload", "seed8", "--no-plots", "--output-dir", str(tmp_path),
            "--kv-cache-memory-bytes", "1G", "--max-model-len", "4k",
            "--max-num-batched-tokens", "2K"]
    assert main(argv) == 0
    config = json.loads((tmp_path / "simulation.json").read_text())["runs"][0]["config"]
    assert (config["max_model_len"], config["max_num_batched_tokens"]) == (4000, 2048)
    assert config["num_kv_blocks"] == min((1 << 30) // (23040 * 16), 8 * 250 + 1)
    assert main([*argv[:-4], "--max-model-len", "auto"]) == 0
