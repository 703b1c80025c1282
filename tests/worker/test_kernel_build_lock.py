"""The C++ kernels' build must not hang on a lock file left by a build that was killed."""

import os
import subprocess
import sys

import pytest

from inflight.kernels import cpu


def test_a_killed_builds_lock_file_does_not_hang_the_next_start():
    """torch's extension loader waits, with no time limit, for its build directory's
    ``lock`` file to go away, even when the build is cached: a build killed mid-way (a
    Ctrl-C during the first start) hung every later start. A fresh process must now load
    the kernels within the time limit and leave no lock file behind."""
    if not cpu.available():
        pytest.skip("the C++ kernel could not be built here")
    from torch.utils.cpp_extension import _get_build_directory

    lock = os.path.join(_get_build_directory(cpu._build_name(), verbose=False), "lock")
    open(lock, "w").close()  # as a killed build leaves it
    try:
        result = subprocess.run(
            [sys.executable, "-c", "from inflight.kernels import cpu; print(cpu.available())"],
            capture_output=True, text=True, timeout=120,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the kernels' load waited on the stale lock file")
    finally:
        stale = os.path.exists(lock)
        if stale:
            os.remove(lock)
    assert result.stdout.strip() == "True", result.stderr[-2000:]
    assert not stale


def test_only_a_present_lock_file_is_removed(tmp_path):
    assert cpu.clear_stale_build_lock(str(tmp_path)) is False
    (tmp_path / "lock").write_text("")
    (tmp_path / "other").write_text("")
    assert cpu.clear_stale_build_lock(str(tmp_path)) is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other"]
