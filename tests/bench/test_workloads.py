"""Workload generators: identical to the project's make_workload.py, and well-formed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from inflight.bench import workloads

SHARED_SCRIPT = Path(__file__).resolve().parents[3] / "shared" / "bench" / "make_workload.py"


@pytest.mark.parametrize("kind", [["seed8"], ["mixed"], ["online", "0.5"]])
def test_named_workloads_match_the_shared_generator(kind: list[str]) -> None:
    if not SHARED_SCRIPT.is_file():
        pytest.skip(f"{SHARED_SCRIPT} is not available")
    text = subprocess.run(
        [sys.executable, str(SHARED_SCRIPT), *kind], check=True, capture_output=True, text=True
    ).stdout
    expected = [json.loads(line) for line in text.splitlines() if line.strip()]
    rate = float(kind[1]) if len(kind) > 1 else None
    assert [r.to_json() for r in workloads.named(kind[0], rate).requests] == expected


def test_seed8_is_the_source_documents_example() -> None:
    w = workloads.seed8()
    assert [r.max_tokens for r in w.requests] == [500] + [50] * 7
    assert all(len(r.prompt_token_ids) == 128 for r in w.requests)


def test_synthetic_lengths_stay_in_range() -> None:
    w = workloads.synthetic(50, input_len=100, output_len=20, range_ratio=0.5, seed=3)
    assert len(w.requests) == 50
    assert all(50 <= len(r.prompt_token_ids) <= 150 for r in w.requests)
    assert all(10 <= r.max_tokens <= 30 for r in w.requests)
    fixed = workloads.synthetic(4, input_len=7, output_len=5)
    assert {(len(r.prompt_token_ids), r.max_tokens) for r in fixed.requests} == {(7, 5)}


def test_head_repeat_and_file_round_trip(tmp_path: Path) -> None:
    w = workloads.mixed().head(5).repeat(2)
    assert w.name == "mixed[:5]x2" and len(w.requests) == 10
    assert [r.id for r in w.requests] == list(range(10))
    assert w.requests[7].prompt_token_ids == w.requests[2].prompt_token_ids
    w.write_jsonl(tmp_path / "w.jsonl")
    back = workloads.resolve(str(tmp_path / "w.jsonl"))
    assert back.requests == w.requests and back.num_output_tokens == w.num_output_tokens


def test_fit_to_vocab_keeps_lengths_and_folds_ids() -> None:
    w = workloads.seed8()
    folded, changed = workloads.fit_to_vocab(w, 512)
    assert changed
    assert all(64 <= t < 512 for r in folded.requests for t in r.prompt_token_ids)
    assert [len(r.prompt_token_ids) for r in folded.requests] == [128] * 8
    assert workloads.fit_to_vocab(folded, 512) == (folded, False)


def test_bad_workloads_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        workloads.resolve("no-such-workload")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_token_ids": [1, 2]}\n')
    with pytest.raises(ValueError, match="max_tokens"):
        workloads.resolve(str(bad))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("[1, 2, 3]", "each line must be a JSON object, got list"),
        ("null", "each line must be a JSON object"),
        ('{"prompt_token_ids": "abc", "max_tokens": 3}', "prompt_token_ids must be"),
        ('{"prompt_token_ids": [[1, 2]], "max_tokens": 3}', "prompt_token_ids must be"),
        ('{"prompt_token_ids": [1, 2.5], "max_tokens": 3}', "prompt_token_ids must be"),
        ('{"prompt_token_ids": [1], "max_tokens": "4"}', "max_tokens must be an integer"),
        ('{"prompt_token_ids": [1], "max_tokens": 4.7}', "max_tokens must be an integer"),
        ('{"prompt_token_ids": [1], "max_tokens": 4, "arrival_s": NaN}', "arrival_s must be"),
        ('{"prompt_token_ids": [1], "max_tokens": 4, "arrival_s": -1}', "arrival_s must be"),
        ('{"prompt_token_ids": [1], "max_tokens": 4, "think_s": "soon"}', "think_s must be"),
        ("{not json", "Expecting"),
    ],
)
def test_a_bad_workload_line_is_named_by_file_and_line(
    tmp_path: Path, line: str, message: str
) -> None:
    """(A line that was not an object was an AttributeError; a NaN arrival hung the
    simulator; other bad values named neither the file nor the line.)"""
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt_token_ids": [1, 2], "max_tokens": 2}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"w.jsonl:2: .*{re.escape(message)}"):
        workloads.read_jsonl(path)
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="not UTF-8"):
        workloads.read_jsonl(path)


@pytest.mark.parametrize(
    "argv",
    [
        ["calibrate", "--threads", "0"],
        ["calibrate", "--batch-sizes", "abc"],
        ["calibrate", "--batch-sizes", ","],
        ["calibrate", "--context-lens", "0"],
        ["calibrate", "--decode-steps", "0"],
        ["calibrate", "--skip-steps", "-1"],
        ["calibrate", "--kv-bytes-per-token", "-5"],
        ["bench", "throughput", "--threads", "-2", "--dry-run"],
        ["bench", "serve", "--max-concurrency", "0", "--dry-run"],
        ["simulate", "--ttft-slo", "nan"],
        ["serve", "--request-timeout", "0"],
        ["serve", "--shutdown-timeout", "-1"],
        ["serve", "--host", "999.1.1.1"],
        ["bench", "throughput", "--range-ratio", "2", "--dry-run"],
        ["bench", "serve", "--port", "99999", "--dry-run"],
        ["bench", "serve", "--num-prompts", "0", "--dry-run"],
        ["bench", "serve", "--request-timeout", "nan", "--dry-run"],
        ["bench", "serve", "--base-url", "ftp://x", "--dry-run"],
    ],
)
def test_bad_numbers_are_usage_errors_naming_the_option(argv: list[str], capsys) -> None:
    """(--threads 0 was a traceback from torch; calibrate's sweep options failed after the
    model had loaded, naming no option.)"""
    from inflight.entrypoints.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    option = next(a for a in argv if a.startswith("--"))
    assert f"argument {option}" in err, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "serve", "--dry-run", "--random-token-low", "500", "--random-token-high", "10"],
         "--random-token-low (500) must be below --random-token-high (10)"),
        (["simulate", "--workload", "seed8", "--sweep", "max_num_seqs=a,b"],
         "--sweep max_num_seqs wants numbers"),
        (["simulate", "--workload", "seed8", "--sweep", "request_rate=0,1"],
         "--sweep request_rate wants finite positive numbers"),
        (["simulate", "--workload", "seed8", "--sweep", "max_num_seqs=1.5"],
         "--sweep max_num_seqs wants whole numbers"),
        # A dry run refuses what the engine would (it exited 0 with max_num_seqs -1).
        (["bench", "throughput", "--dry-run", "--workload", "seed8", "--max-num-seqs", "-1"],
         "max_num_seqs must be >= 1"),
    ],
)
def test_bad_option_values_found_after_parsing_name_the_option(
    argv: list[str], message: str, capsys
) -> None:
    from inflight.entrypoints.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"inflight: error: {message}" in err and "Traceback" not in err, err


def test_bench_serve_reads_workload_files_as_bench_throughput_does(tmp_path: Path) -> None:
    """(Its own reader took any field as it came; a binary file named no file.) The same
    line-by-line checks, with a text ``prompt`` allowed."""
    from inflight.bench.serve_workload import read_workload_file

    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "Hello", "max_tokens": 2}\n'
                    '{"prompt_token_ids": [5, 6], "max_tokens": 3, "arrival_s": 0.5}\n')
    text, ids = read_workload_file(str(path), None)
    assert (text.prompt, text.max_tokens) == ("Hello", 2)
    assert (ids.prompt, ids.max_tokens, ids.arrival_s) == ([5, 6], 3, 0.5)
    for line, message in (('{"prompt": "", "max_tokens": 2}', "prompt must be"),
                          ('{"prompt": "Hi", "max_tokens": 2, "arrival_s": NaN}', "arrival_s"),
                          ("[1]", "JSON object")):
        path.write_text(line + "\n")
        with pytest.raises(ValueError, match=f"w.jsonl:1: .*{message}"):
            read_workload_file(str(path), None)
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="w.jsonl is not UTF-8"):
        read_workload_file(str(path), None)


def test_a_cost_file_that_is_not_one_is_named(tmp_path: Path) -> None:
    from inflight.planner.cost_model import load_cost_model

    for text in ('{"a": 1}', "[1]", "not json"):
        path = tmp_path / "cost.json"
        path.write_text(text)
        with pytest.raises(ValueError, match="cost.json is not a cost model from 'inflight calibrate'"):
            load_cost_model(path)


@pytest.mark.parametrize("rate", [float("nan"), -1.0, 0.0, float("inf")])
def test_a_request_rate_must_be_positive_and_finite(rate: float) -> None:
    with pytest.raises(ValueError, match="request rate must be positive"):
        workloads.mixed(rate=rate)
    with pytest.raises(ValueError, match="request rate must be positive"):
        workloads.named("online", rate)


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "--workload", "online", "--request-rate", "nan", "--num-prompts", "5"],
        ["simulate", "--workload", "online", "--request-rate", "-1", "--num-prompts", "5"],
        ["bench", "throughput", "--workload", "online", "--rate", "0", "--dry-run"],
        ["bench", "workload", "online", "--rate", "inf", "-o", "unused.jsonl"],
        ["bench", "serve", "--request-rate", "nan", "--dry-run"],
    ],
)
def test_bad_rates_stop_the_cli_before_it_runs(argv: list[str], capsys) -> None:
    from inflight.entrypoints.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "request rate must be positive" in capsys.readouterr().err
