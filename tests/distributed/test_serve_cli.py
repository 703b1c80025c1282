"""``inflight serve``'s data-parallel options, checked before any model loads."""

from __future__ import annotations

import importlib.util

import pytest

from inflight.entrypoints.cli import build_parser, main


def test_vllm_option_names_parse() -> None:
    args = build_parser().parse_args(
        ["serve", "m", "--data-parallel-size", "2", "--data-parallel-backend", "ray",
         "--data-parallel-address", "auto"]
    )
    assert (args.data_parallel_size, args.data_parallel_backend, args.data_parallel_address) == (
        2, "ray", "auto"
    )


def test_without_ray_one_line_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name == "ray" else real_find_spec(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert main(["serve", "--data-parallel-size", "2", "--data-parallel-backend", "ray"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'inflight[ray]'" in err


def test_size_above_one_needs_a_backend(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--data-parallel-size", "2"]) == 2
    assert "--data-parallel-backend ray" in capsys.readouterr().err
