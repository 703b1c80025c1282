"""Shared fixtures: a tiny random Llama checkpoint on disk, built in the test session."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers.tiny_model import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(autouse=True)
def _quiet_env() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# Figures that tests measure for the README (soak, storms, fuzzing), shown at the end of
# the run under "figures" whatever the capture mode, so CI logs carry them.
_FIGURES: list[str] = []


@pytest.fixture
def report_figure() -> Callable[[str], None]:
    return _FIGURES.append


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _FIGURES:
        terminalreporter.section("figures")
        for line in _FIGURES:
            terminalreporter.write_line(line)
