"""What a new user sees: defaults in --help, separated answers, progress, lock, KV budget."""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import threading
from pathlib import Path

import pytest

from inflight.bench import workloads
from inflight.bench.hf_baseline import run_transformers
from inflight.bench.lock import bench_lock
from inflight.engine.llm_engine import LLMEngine
from inflight.entrypoints.cli import build_parser, main
from inflight.entrypoints.generate_cli import format_answers


def all_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in set(action.choices.values()):
                found += all_parsers(child)
    return found


def test_every_option_with_a_default_shows_it_in_help() -> None:
    for parser in all_parsers(build_parser())[1:]:
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            default = action.default
            if not action.option_strings or default is None or isinstance(default, bool):
                continue
            if default == argparse.SUPPRESS:
                continue
            assert f"default: {default}" in text or "default" in (action.help or ""), (
                parser.prog,
                action.option_strings,
            )


def test_generate_help_says_greedy_and_128_tokens() -> None:
    (generate,) = [p for p in all_parsers(build_parser()) if p.prog.endswith(" generate")]
    text = " ".join(generate.format_help().split())
    assert "greedy" in text and "128 new tokens" in text
    assert "--max-tokens MAX_TOKENS most new tokens per prompt (default: 128)" in text


def test_several_answers_are_separated(tiny_llama_dir: Path, capsys) -> None:
    prompts = ["w3 w4", "w5 w6 w7"]
    args = ["generate", *prompts, "--model", str(tiny_llama_dir), "--max-tokens", "4"]
    assert main(args) == 0
    out = capsys.readouterr().out
    headed = out.split("=== [")
    assert headed[0] == "" and len(headed) == 3
    # each block is "N] prompt", then that prompt's own answer: the one it gets alone
    for number, (prompt, block) in enumerate(zip(prompts, headed[1:], strict=True), 1):
        header, answer = block.split("\n", 1)
        assert header == f"{number}] {prompt}"
        assert main(["generate", prompt, "--model", str(tiny_llama_dir), "--max-tokens", "4"]) == 0
        alone = capsys.readouterr().out
        assert alone.strip() and answer.strip() == alone.strip()
        assert "===" not in alone  # one prompt: the answer alone, no header
    assert format_answers(["only"], ["text"]) == "text"  # one answer: printed as it is


def test_kv_budget_cap_is_logged(tiny_llama_dir: Path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="inflight.engine.llm_engine"):
        engine = LLMEngine.from_options(
            str(tiny_llama_dir), max_num_seqs=2, kv_cache_memory_bytes=1 << 30
        )
    usable = 2 * -(-engine.max_model_len // engine.config.cache.block_size) + 1
    assert engine.kv_cache.num_blocks == usable
    (record,) = [r for r in caplog.records if "kv_cache_memory_bytes allows" in r.message]
    assert record.levelno == logging.WARNING  # the user chose this budget
    assert f"at most {usable}; using {usable}" in record.message


def test_bench_lock_waits_for_the_holder(tmp_path: Path) -> None:
    path = str(tmp_path / "bench.lock")
    holder = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)
    waiting, acquired = threading.Event(), threading.Event()

    def timed_run() -> None:
        with bench_lock(path, on_wait=lambda message: waiting.set()):
            acquired.set()

    worker = threading.Thread(target=timed_run)
    worker.start()
    assert waiting.wait(60)  # it said it is waiting ...
    assert not acquired.is_set()  # ... and it is: the holder still has the lock
    os.close(holder)
    worker.join(60)
    assert acquired.is_set()
    with bench_lock(None):  # --no-bench-lock
        pass


def test_hf_baseline_shows_progress(tiny_llama_dir: Path, capsys) -> None:
    workload = workloads.synthetic(3, input_len=4, output_len=5, seed=0)
    run_transformers(workload, str(tiny_llama_dir), 2, warmup=False, progress=True)
    err = capsys.readouterr().err
    assert "transformers, 2 batch(es)" in err and "10/10" in err  # 2 batches of 5 steps


@pytest.fixture(autouse=True)
def _private_bench_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BENCH_LOCK", str(tmp_path / "bench.lock"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "w3", "--trace", "/"], "is a folder"),
        (["generate", "w3", "--trace", "/no/such/folder/t.jsonl"], "does not exist"),
        (["generate", "w3", "--device", "xyz"], "device must be"),
        (["bench", "workload", "seed8", "-o", "/"], "Is a directory"),
        # (Blamed the KV cache size alone, naming no block size.)
        (["generate", "w3", "--kv-cache-memory-bytes", "1000", "--block-size", "64"],
         "a block of block_size=64 tokens takes"),
    ],
)
def test_bad_paths_and_values_are_one_line_errors(tiny_llama_dir: Path, argv, message, capsys):
    """Exit 2 with "inflight: error: ..." before any generation, never a traceback."""
    if argv[0] == "generate":
        argv = [*argv, "--model", str(tiny_llama_dir), "--max-tokens", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("inflight: error:") and message in err and "Traceback" not in err


def test_plot_names_a_file_that_is_not_a_trace(tmp_path: Path, capsys) -> None:
    workload = tmp_path / "w.jsonl"
    workload.write_text('{"id": 0, "prompt_token_ids": [1, 2], "max_tokens": 3}\n')
    assert main(["plot", str(workload), "--out-dir", str(tmp_path)]) == 2
    assert f"{workload}:1 is not a step trace record" in capsys.readouterr().err


def test_a_trace_field_of_the_wrong_type_or_range_is_named(tmp_path: Path, capsys) -> None:
    """(A string duration_s was a TypeError traceback in the plot; NaN and negative times
    went into pictures and fits.)"""
    from inflight.engine.step_trace import ScheduledEntry, StepRecord

    good = StepRecord(0, 0.0, 0.01, [ScheduledEntry("r", 0, 4, "prefill")], [], [], 1, 0, 1,
                      8, 2, []).to_json()
    trace = tmp_path / "t.jsonl"
    for field, value, message in (("duration_s", "x", "duration_s must be finite seconds"),
                                  ("start_time", float("nan"), "start_time must be finite"),
                                  ("duration_s", -1, "duration_s must be finite"),
                                  ("num_slots", 1.5, "num_slots must be an integer")):
        trace.write_text(json.dumps(good) + "\n" + json.dumps({**good, field: value}) + "\n")
        assert main(["plot", str(trace), "--out-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert f"{trace}:2 is not a step trace record" in err and message in err, err
    trace.write_bytes(b"\xff\xfe")
    assert main(["plot", str(trace), "--out-dir", str(tmp_path)]) == 2
    assert "is not UTF-8 text" in capsys.readouterr().err


def test_ctrl_c_is_one_line_and_exit_code_130(monkeypatch, capsys) -> None:
    """A Ctrl-C while a model loads (``inflight serve`` before it is ready, a first kernel
    build) or generates printed a page of KeyboardInterrupt traceback."""
    import inflight.entrypoints.generate_cli as generate_cli

    def interrupted(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(generate_cli, "run", interrupted)
    try:
        code = main(["generate", "hello"])
    except KeyboardInterrupt:
        pytest.fail("the KeyboardInterrupt escaped main(): its traceback reaches the user")
    assert code == 130
    assert capsys.readouterr().err == "inflight: interrupted\n"


def test_dp_scaling_failures_are_one_line(monkeypatch, capsys) -> None:
    """python -m inflight.bench.dp_scaling: no Ray, or every replica dead mid-run (a
    co-tenant's memory pressure OOM-killed them here), is one line and exit 1, not a
    traceback; zero prompts or replicas are refused by the parser (were a
    ZeroDivisionError)."""
    from inflight.bench import dp_scaling
    from inflight.engine.request_stream import EngineDeadError

    def dead(*args: object) -> None:
        raise EngineDeadError("no engine replica is alive; retry later")

    monkeypatch.setattr(dp_scaling, "measure", dead)
    assert dp_scaling.main(["--num-prompts", "2"]) == 1
    err = capsys.readouterr().err
    assert err == "python -m inflight.bench.dp_scaling: error: no engine replica is alive; retry later\n"
    for bad in (["--num-prompts", "0"], ["--replicas", "0"], ["--max-tokens", "-1"]):
        with pytest.raises(SystemExit) as exit_info:
            dp_scaling.main(bad)
        assert exit_info.value.code == 2
