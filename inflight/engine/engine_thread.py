"""The one thread on which a served engine computes: loading, warm-up, then the step loop.

Why one thread for all of it: PyTorch's CPU kernels run on OpenMP, and GNU OpenMP keeps a
pool of worker threads for every thread that has started a parallel region, for as long
as that thread lives. Once two pools exist (say the main thread's, from loading the
model and warming it up, and the engine thread's) and together they hold more threads
than there are CPUs, libgomp stops spinning between parallel regions ("throttled" waits
of ~100 spins) and every region pays a futex wake-up instead. A decode step runs a few
hundred regions, so on the 2-core AMD EPYC (Zen 5) a single stream's step took 10.1 ms in
the server against 4.5 ms offline; with every computation on one thread it is level with
offline again. ``tests/server/test_engine_thread.py`` checks that the server's model runs
on this thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")

_Job = tuple["Future[object]", Callable[[], object]]


class EngineThread:
    """A daemon thread that runs the jobs it is given, one after another, in order."""

    def __init__(self, name: str = "inflight-engine") -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn()`` on this thread and wait: its result, or its exception raised here."""
        future: Future[T] = Future()
        self._jobs.put((future, fn))  # type: ignore[arg-type]
        return future.result()

    def run_last(self, fn: Callable[[], object]) -> None:
        """Queue ``fn()`` as the last job (the engine loop): the thread ends with it.
        Its exceptions are its own business (the loop reports its death itself)."""
        self._jobs.put((Future(), fn))
        self._jobs.put(None)

    def stop(self) -> None:
        """End the thread once the jobs queued so far have run."""
        self._jobs.put(None)

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn = job
            try:
                future.set_result(fn())
            except BaseException as error:  # noqa: BLE001 - handed to the caller
                future.set_exception(error)
