"""Fixtures shared by the kernel tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def two_threads() -> Iterator[None]:
    """The kernels on 2 threads (so work is split between them, as on this project's
    machines), restoring the thread count after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)
