"""A record of every engine step, for pictures of the schedule and for tests.

Each :class:`StepRecord` says which requests ran in which batch slot with how many
tokens (prefill or decode), who was preempted or finished, queue lengths, and KV block
use. Slots held by a request that did no work this step are ``idle_slots`` (static
batching keeps finished members' slots that way); unheld slots are empty.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from inflight.jsonl import numbered_lines

if TYPE_CHECKING:
    from inflight.core.interface import RequestUpdate, SchedulerOutput
    from inflight.core.scheduler import Scheduler


@dataclass(frozen=True, slots=True)
class ScheduledEntry:
    request_id: str
    slot: int
    num_tokens: int
    kind: str  # "prefill" or "decode"
    # Prompt tokens taken from the prefix cache when the request was admitted this step.
    num_cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class StepRecord:
    step: int
    start_time: float  # seconds since the trace started
    duration_s: float
    entries: list[ScheduledEntry]
    preempted: list[str]
    finished: list[str]
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_slots: int
    idle_slots: list[int]

    @property
    def num_batched_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries)

    @property
    def batch_size(self) -> int:
        return len(self.entries)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, row: dict) -> StepRecord:
        """A record written by :meth:`to_json`; ``ValueError`` naming a field of the
        wrong type or range (a trace feeds pictures and fits, which would fail far from
        the cause)."""
        for name in ("start_time", "duration_s"):
            value = row[name]
            if not _is_number(value) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be finite seconds >= 0, got {value!r}")
        for name in ("step", "num_running", "num_waiting", "kv_blocks_used",
                     "kv_blocks_total", "num_slots"):
            _check_count(name, row[name])
        entries = [ScheduledEntry(**e) for e in row["entries"]]
        for entry in entries:
            _check_count("entries' slot", entry.slot)
            _check_count("entries' num_tokens", entry.num_tokens)
            if entry.kind not in ("prefill", "decode"):
                raise ValueError(f"entries' kind must be prefill or decode, got {entry.kind!r}")
        return cls(**{**row, "entries": entries})


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_count(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


@dataclass
class StepTrace:
    enabled: bool = False
    records: list[StepRecord] = field(default_factory=list)

    def append(self, record: StepRecord) -> None:
        if self.enabled:
            self.records.append(record)

    def clear(self) -> None:
        self.records.clear()

    def write_jsonl(self, path: str | Path) -> None:
        with open(path, "w", encoding="utf-8") as f:
            for record in self.records:
                f.write(json.dumps(record.to_json()) + "\n")

    @staticmethod
    def read_jsonl(path: str | Path) -> list[StepRecord]:
        """The records of a trace file; ValueError naming the file and line for anything
        else (a workload file, a truncated line)."""
        records = []
        for number, line in numbered_lines(path, "a step trace"):
            try:
                records.append(StepRecord.from_json(json.loads(line)))
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(
                    f"{path}:{number} is not a step trace record (written by --trace or "
                    f"record_trace=True): {type(error).__name__}: {error}"
                ) from None
        return records


def record_step(
    scheduler: Scheduler, output: SchedulerOutput, updates: list[RequestUpdate],
    start_time: float, duration_s: float,
) -> StepRecord:
    """The record of one step, read right after ``update_from_output`` (queues and KV use
    as the step left them). Used by the engine and by the planner's simulator alike."""
    entries = [
        ScheduledEntry(
            s.request_id, s.slot, s.num_tokens, "prefill" if s.is_prefill else "decode",
            s.num_cached_tokens,
        )
        for s in output.scheduled
    ]
    busy = {e.slot for e in entries}
    owners = scheduler.slots.owners
    kv_cache = scheduler.kv_cache
    return StepRecord(
        step=output.step_id,
        start_time=start_time,
        duration_s=duration_s,
        entries=entries,
        preempted=list(output.preempted_request_ids),
        finished=[u.request_id for u in updates if u.finished],
        num_running=scheduler.num_running,
        num_waiting=scheduler.num_waiting,
        kv_blocks_used=kv_cache.pool.num_used_blocks,
        kv_blocks_total=kv_cache.num_blocks,
        num_slots=scheduler.slots.num_slots,
        idle_slots=[i for i, owner in enumerate(owners) if owner is not None and i not in busy],
    )
