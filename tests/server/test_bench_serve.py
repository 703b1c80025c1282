"""``inflight bench serve`` against the running server: every request measured, JSON out."""

from __future__ import annotations

import json
from pathlib import Path

from server_harness import API_KEY, ServerProcess

from inflight.entrypoints.cli import main

STAT_KEYS = [
    f"{stat}_{metric}_ms"
    for metric in ("ttft", "tpot", "itl", "e2el")
    for stat in ("mean", "median", "p95", "p99")
]


def test_synthetic_all_at_once(tiny_server: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "synthetic.json"
    code = main(
        [
            "bench",
            "serve",
            "--base-url",
            tiny_server.url,
            "--api-key",
            API_KEY,
            "--num-prompts",
            "12",
            "--random-input-len",
            "6",
            "--random-output-len",
            "10",
            "--random-token-low",
            "3",
            "--random-token-high",
            "500",
            "--request-rate",
            "inf",
            "--result-json",
            str(out),
            "--disable-tqdm",
            "--no-bench-lock",
            "--label",
            "smoke",
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["model"] == "tiny" and result["request_rate"] == "inf"
    assert result["total_input_tokens"] == 12 * 6
    assert result["total_output_tokens"] == 12 * 10
    for key in STAT_KEYS:
        assert result[key] >= 0, key
    assert result["median_ttft_ms"] <= result["p99_ttft_ms"]
    assert result["request_throughput"] > 0 and result["output_throughput"] > 0
    assert all(r["ok"] and r["output_tokens"] == 10 for r in result["requests"])


def test_workload_file_with_arrivals_and_concurrency_cap(
    tiny_server: ServerProcess, tmp_path: Path
) -> None:
    workload = tmp_path / "workload.jsonl"
    rows = [
        {
            "id": i,
            "prompt_token_ids": [3 + i, 4 + i, 5 + i],
            "max_tokens": 4 + i,
            "arrival_s": 0.05 * i,
        }
        for i in range(6)
    ]
    workload.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "workload.json"
    code = main(
        [
            "bench",
            "serve",
            "--base-url",
            tiny_server.url,
            "--api-key",
            API_KEY,
            "--workload",
            str(workload),
            "--num-prompts",
            "5",
            "--max-concurrency",
            "2",
            "--result-json",
            str(out),
            "--disable-tqdm",
            "--no-bench-lock",
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 5 and result["request_rate"] == "workload"
    assert result["total_output_tokens"] == sum(4 + i for i in range(5))
    assert result["duration_s"] >= 0.2  # the last request is not sent before 0.2 s


def test_named_workloads_are_generated_in_process(capsys) -> None:
    """``--workload online --rate 0.5`` is make_workload.py's ``online 0.5``, no file needed."""
    from inflight.bench import serve, workloads

    expected = workloads.online(0.5).requests[:40]
    requests = serve.load_workload("online", 40, 0.5)
    assert [(r.prompt, r.max_tokens, r.arrival_s) for r in requests] == [
        (e.prompt_token_ids, e.max_tokens, e.arrival_s) for e in expected
    ]
    # The workload's own arrivals are kept unless --request-rate overrides them.
    assert serve.schedule(requests, None, 0) == requests
    args = ["bench", "serve", "--workload", "seed8", "--dry-run", "--port", "9"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "8 requests" in out and "1024 prompt tokens" in out and "850 output tokens" in out


def test_multi_turn_turns_resend_the_answered_history(
    tiny_server: ServerProcess, tmp_path: Path
) -> None:
    """Each turn goes out after its previous answer, its prompt holding that prompt and
    answer (so the server's prefix cache serves the history)."""
    from inflight.bench import workloads

    small = workloads.multi_turn(2, 3, first_len=(40, 60), user_len=(8, 16), output_len=(8, 16))
    small = workloads.fit_to_vocab(small, 512)[0]
    path = tmp_path / "multi-turn.jsonl"
    small.write_jsonl(path)
    out = tmp_path / "multi-turn.json"
    args = ["bench", "serve", "--base-url", tiny_server.url, "--api-key", API_KEY]
    args += ["--workload", str(path), "--result-json", str(out), "--disable-tqdm"]
    assert main([*args, "--no-bench-lock"]) == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    lens = workloads.full_prompt_lens(small.requests)
    # A turn's prompt length is only right if it carried the previous answer's tokens.
    assert [r["prompt_tokens"] for r in result["requests"]] == [lens[r.id] for r in small.requests]
    later = [
        r for r, w in zip(result["requests"], small.requests, strict=True) if w.after is not None
    ]
    assert all(r["cached_tokens"] > 0 for r in later)
    assert (
        result["prefill_tokens_computed"]
        == result["total_input_tokens"] - result["total_cached_tokens"]
    )


def one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


def test_unreachable_server_is_one_clear_line(tmp_path: Path, capsys) -> None:
    from server_harness import free_port

    port = free_port()  # nothing listens there once the probe socket is closed
    args = ["bench", "serve", "--port", str(port), "--num-prompts", "2", "--disable-tqdm"]
    assert main([*args, "--bench-lock", str(tmp_path / "lock")]) == 1
    line = one_line_error(capsys)
    assert "cannot reach the server" in line and str(port) in line


def test_wrong_api_key_is_one_clear_line(tiny_server: ServerProcess, capsys) -> None:
    args = ["bench", "serve", "--base-url", tiny_server.url, "--api-key", "sk-wrong"]
    assert main([*args, "--num-prompts", "2", "--disable-tqdm", "--no-bench-lock"]) == 1
    line = one_line_error(capsys)
    assert "refused the API key" in line and "401" in line
