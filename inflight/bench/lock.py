"""The benchmark lock: timed runs on a shared machine never overlap.

Every timed run (inflight's ``bench throughput`` and ``bench serve``, and the peers'
``run_peers.sh``) holds an exclusive ``flock`` on one file, ``/tmp/bench.lock`` unless
``$BENCH_LOCK`` or ``--bench-lock PATH`` names another; ``--no-bench-lock`` skips it.
The lock is released when the run ends, or when its process dies.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

DEFAULT_BENCH_LOCK = "/tmp/bench.lock"


def add_lock_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("benchmark lock")
    group.add_argument(
        "--bench-lock",
        metavar="PATH",
        default=None,
        help=f"hold an exclusive flock on PATH during the timed run, shared with the peers' "
        f"run_peers.sh (default: $BENCH_LOCK, else {DEFAULT_BENCH_LOCK})",
    )
    group.add_argument(
        "--no-bench-lock",
        dest="use_bench_lock",
        action="store_false",
        default=True,
        help="run without taking the lock (default: take it)",
    )


def lock_path(args: argparse.Namespace) -> str | None:
    """The lock file to hold for this run, or None when ``--no-bench-lock``."""
    if not args.use_bench_lock:
        return None
    return args.bench_lock or os.environ.get("BENCH_LOCK") or DEFAULT_BENCH_LOCK


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextmanager
def bench_lock(path: str | None, on_wait: Callable[[str], None] = _say) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` for the block (nothing when ``path`` is None).

    Tries without blocking first; if another run holds the lock, calls ``on_wait`` once
    with a message saying so, then waits as long as it takes.
    """
    if path is None:
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait(
                f"waiting for the benchmark lock {path} (another timed run holds it; a run "
                f"started under `flock {path}` waits for its own parent: drop the flock or "
                "pass --no-bench-lock) ..."
            )
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the only descriptor releases the lock
