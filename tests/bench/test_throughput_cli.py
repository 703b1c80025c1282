"""``inflight bench throughput`` end to end on the tiny model: counts, files, ratios."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inflight.bench import workloads
from inflight.bench.engine_run import run_isolated
from inflight.bench.report import peak_rss_mib, slot_steps
from inflight.engine.step_trace import StepTrace
from inflight.entrypoints.cli import main

RUNS = ["inflight static", "inflight continuous", "transformers static"]


def test_report_token_counts_equal_the_workloads(bench_run) -> None:
    expected = workloads.synthetic(6, input_len=16, output_len=8, range_ratio=0.5, seed=0)
    runs = bench_run.results["runs"]
    assert [r["label"] for r in runs] == RUNS
    for run in runs:
        assert run["num_requests"] == 6
        assert run["num_prompt_tokens"] == expected.num_prompt_tokens
        assert run["num_output_tokens"] == expected.num_output_tokens
        assert [x["num_output_tokens"] for x in run["requests"]] == [
            r.max_tokens for r in expected.requests
        ]
        assert run["output_tokens_per_s"] == pytest.approx(
            expected.num_output_tokens / run["wall_time_s"]
        )
        assert run["peak_rss_mib"] > 0 and run["ttft"]["mean"] > 0


def test_report_schedule_figures_come_from_the_saved_traces(bench_run) -> None:
    for run in bench_run.results["runs"]:
        records = StepTrace.read_jsonl(run["trace_path"])
        counts = slot_steps(records, 4)
        assert run["num_steps"] == len(records)
        assert run["slots"]["working"] == counts.working
        assert run["slots"]["utilisation"] == pytest.approx(counts.working / (4 * len(records)))
        # every output token is one working slot-step
        assert counts.working == run["num_output_tokens"]
    static, continuous, hf = bench_run.results["runs"]
    assert continuous["slots"]["idle"] == 0 and static["slots"]["idle"] > 0
    assert continuous["num_steps"] < static["num_steps"] == hf["num_steps"]
    assert static["slots"]["idle"] == hf["slots"]["idle"]  # the same static schedule
    ratio_pairs = [(r["numerator"], r["denominator"]) for r in bench_run.results["ratios"]]
    assert ratio_pairs == [(RUNS[1], RUNS[0]), (RUNS[1], RUNS[2])]


def test_bench_writes_traces_and_pictures_next_to_the_json(bench_run) -> None:
    names = {p.name for p in bench_run.out_dir.iterdir()}
    assert {
        "results.json",
        "timeline.png",
        "batch_kv.png",
        "latency.png",
        "throughput.png",
    } <= names
    assert {
        "trace_inflight_static.jsonl",
        "trace_inflight_continuous.jsonl",
        "trace_transformers_static.jsonl",
    } <= names


def test_jsonl_workload_and_single_policy(tiny_llama_dir: Path, tmp_path: Path, capsys) -> None:
    workloads.synthetic(3, input_len=5, output_len=3, seed=1).write_jsonl(tmp_path / "w.jsonl")
    code = main(
        [
            "bench",
            "throughput",
            "--model",
            str(tiny_llama_dir),
            "--workload",
            str(tmp_path / "w.jsonl"),
            "--batching",
            "static",
            "--no-isolate",
            "--no-plots",
            "--no-warmup",
            "--output-json",
            str(tmp_path / "out" / "r.json"),
        ]
    )
    assert code == 0
    assert "inflight static" in capsys.readouterr().out
    runs = json.loads((tmp_path / "out" / "r.json").read_text())["runs"]
    assert [r["num_output_tokens"] for r in runs] == [9]
    assert not (tmp_path / "out" / "timeline.png").exists()


def test_missing_workload_is_a_clear_error(capsys) -> None:
    assert main(["bench", "throughput", "--no-isolate"]) == 2
    assert "--workload" in capsys.readouterr().err


def test_isolated_runs_report_their_own_process() -> None:
    assert run_isolated(peak_rss_mib) > 0


def test_sampling_extras_reach_every_request(tiny_llama_dir: Path) -> None:
    from inflight import LLM
    from inflight.bench.engine_run import SAMPLING_EXTRAS, generate_workload
    from inflight.bench.workloads import Workload, WorkloadRequest

    llm = LLM(str(tiny_llama_dir), dtype="float32")
    workload = Workload("w", [WorkloadRequest(i, [5 + i, 9, 11, 9], 6) for i in range(3)])
    plain = generate_workload(llm.llm_engine, workload)
    extras = generate_workload(llm.llm_engine, workload, sampling_extras=True)
    k = SAMPLING_EXTRAS["logprobs"]
    for a, b in zip(plain, extras, strict=True):
        assert a.outputs[0].logprobs is None and len(b.outputs[0].token_ids) == 6
        assert b.outputs[0].logprobs is not None
        assert all(len(position) >= k for position in b.outputs[0].logprobs)
