"""Batching policies: who may be admitted now, and when a batch slot is given back.

* :class:`ContinuousBatching` admits any waiting request as soon as budget, blocks and a
  slot allow, and frees a slot the moment its request leaves.
* :class:`StaticBatching` is the source document's baseline: it forms a batch of up to
  ``max_num_seqs`` waiting requests, admits nobody else until every member has finished,
  and keeps finished members' slots held (idle) until then.
"""

from __future__ import annotations

from typing import Protocol

from inflight.core.request import Request
from inflight.core.request_queue import RequestQueue
from inflight.core.slots import SlotTable


class BatchingPolicy(Protocol):
    def admissible(self, waiting: RequestQueue) -> list[Request]:
        """Waiting requests that may be admitted now, in the order to try them."""
        ...

    def on_admitted(self, request: Request) -> int:
        """Give the request a slot; returns the slot index."""
        ...

    def on_left(self, request: Request, finished: bool) -> None:
        """The request left the running list: finished (or aborted) or preempted."""
        ...


class ContinuousBatching:
    def __init__(self, slots: SlotTable) -> None:
        self.slots = slots

    def admissible(self, waiting: RequestQueue) -> list[Request]:
        return list(waiting)

    def on_admitted(self, request: Request) -> int:
        return self.slots.assign(request.request_id)

    def on_left(self, request: Request, finished: bool) -> None:
        self.slots.release(request.request_id)


class StaticBatching:
    def __init__(self, slots: SlotTable) -> None:
        self.slots = slots
        self._members: set[str] = set()  # unfinished members of the current batch
        self._holders: list[str] = []  # every member of the current batch

    def admissible(self, waiting: RequestQueue) -> list[Request]:
        if not self._members:
            self._start_batch(waiting)
        return [r for r in waiting if r.request_id in self._members]

    def _start_batch(self, waiting: RequestQueue) -> None:
        for request_id in self._holders:
            self.slots.release(request_id)
        batch = list(waiting)[: self.slots.num_slots]
        self._members = {r.request_id for r in batch}
        self._holders = [r.request_id for r in batch]

    def on_admitted(self, request: Request) -> int:
        return self.slots.assign(request.request_id)

    def on_left(self, request: Request, finished: bool) -> None:
        # A preempted member stays in the batch (and keeps its slot) until it finishes.
        if finished:
            self._members.discard(request.request_id)


def make_batching_policy(mode: str, slots: SlotTable) -> BatchingPolicy:
    if mode == "continuous":
        return ContinuousBatching(slots)
    if mode == "static":
        return StaticBatching(slots)
    raise ValueError(f"unknown batching mode {mode!r}; use 'continuous' or 'static'")
