"""Records the async engine publishes about itself (pure Python, no prometheus).

The engine thread owns the numbers: after every iteration it replaces its
:class:`EngineStats` snapshot wholesale (readers on other threads see either the old or
the new record, never a half-updated one), and it hands one :class:`FinishedRequestStats`
to each :class:`StatObserver` whenever a request ends, however it ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's state after its latest iteration; ``*_total`` fields only grow."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    num_kv_blocks_used: int = 0
    num_kv_blocks_total: int = 0
    num_preemptions_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_steps_total: int = 0


@dataclass(frozen=True, slots=True)
class FinishedRequestStats:
    """One request's life, in seconds; ``finish_reason`` is stop, length, abort or error."""

    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    e2e_latency: float
    time_to_first_token: float | None  # None when no token was produced
    time_per_output_token: float | None  # None with fewer than two output tokens


class StatObserver(Protocol):
    """Told about every finished request, on the engine thread: must be quick and thread-safe."""

    def on_request_finished(self, stats: FinishedRequestStats) -> None: ...
