"""Shared fixtures: a tiny random Llama checkpoint on disk, built in the test session."""

from __future__ import annotations

import os
import sys
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
