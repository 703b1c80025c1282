"""Fixtures for the benchmark tests: one small bench run shared by the CLI and plot tests."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from inflight.entrypoints.cli import main


@dataclass
class BenchRun:
    out_dir: Path
    results: dict


@pytest.fixture(scope="session", autouse=True)
def _private_bench_lock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Tests never wait for (or hold up) real benchmarks on the machine's shared lock."""
    saved = os.environ.get("BENCH_LOCK")
    os.environ["BENCH_LOCK"] = str(tmp_path_factory.mktemp("lock") / "bench.lock")
    yield
    if saved is None:
        os.environ.pop("BENCH_LOCK", None)
    else:
        os.environ["BENCH_LOCK"] = saved


@pytest.fixture(scope="session")
def bench_run(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> BenchRun:
    """Static, continuous and transformers on 6 synthetic requests with 4 slots, in-process."""
    out_dir = tmp_path_factory.mktemp("bench")
    code = main(
        [
            "bench",
            "throughput",
            "--model",
            str(tiny_llama_dir),
            "--dtype",
            "float32",
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--range-ratio",
            "0.5",
            "--num-prompts",
            "6",
            "--max-num-seqs",
            "4",
            "--compare",
            "--hf-baseline",
            "--no-isolate",
            "--no-bench-lock",
            "--output-json",
            str(out_dir / "results.json"),
        ]
    )
    assert code == 0
    return BenchRun(out_dir, json.loads((out_dir / "results.json").read_text()))
