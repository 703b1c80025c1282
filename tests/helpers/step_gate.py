"""Hold an engine's progress at an observable state, so tests never race the machine's speed.

A test that must act "while a request is running" (disconnect, abort, shut down) cannot
rely on the request being slow: the tiny model makes 480 tokens in a quarter of a second
on a fast machine. :class:`StepGate` replaces ``LLMEngine.step`` on one engine instance:
while its predicate holds, a step does nothing (no tokens, no outputs) and returns at
once, so the engine thread keeps draining its command queue (adds, aborts, shutdown)
but no request advances. When the predicate turns false (e.g. the request was aborted,
or a new one arrived), real steps resume. A gate that holds for longer than
``max_hold_s`` lets go for good and records it, so a broken server fails the test's
assertions instead of hanging it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

Predicate = Callable[[list[Any]], bool]  # the scheduler's live requests -> hold?


class StepGate:
    def __init__(self, engine: Any, hold_while: Predicate, max_hold_s: float = 60.0) -> None:
        self._engine = engine
        self._hold_while = hold_while
        self._max_hold_s = max_hold_s
        self._held_since: float | None = None
        self.gave_up = False  # the predicate held past max_hold_s
        self.held = threading.Event()  # set the first time a step was held
        self._original = engine.step
        engine.step = self._step

    def remove(self) -> None:
        self._engine.step = self._original

    def _step(self) -> Any:
        live = [r for r in self._engine.scheduler.requests.values() if not r.is_finished]
        if not self.gave_up and live and self._hold_while(live):
            now = time.monotonic()
            self._held_since = self._held_since or now
            if now - self._held_since < self._max_hold_s:
                self.held.set()
                time.sleep(0.002)  # an empty step: commands are still drained between them
                return []
            self.gave_up = True
        self._held_since = None
        return self._original()


def once_all_have(min_tokens: int) -> Predicate:
    """Hold while every live request has at least ``min_tokens`` output tokens.

    A request that joins later (still short of its tokens) makes the gate run real steps
    until it catches up, so late arrivals are prefilled rather than starved; the others
    advance by those few steps only.
    """

    def hold(live: list[Any]) -> bool:
        return all(r.num_output_tokens >= min_tokens for r in live)

    return hold
