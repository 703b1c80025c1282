"""Handing the engine thread's results to the asyncio event loop, in order.

The engine thread collects one iteration's acceptance replies and deltas in an
:class:`Outbox`, then passes the batch to :func:`deliver_on_loop` with a single
``loop.call_soon_threadsafe``, so a stream always sees "accepted" before its first delta.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from inflight.engine.request_stream import RequestDelta, RequestStream

Reply = tuple["asyncio.Future[None]", BaseException | None]
Delivery = tuple[RequestStream, RequestDelta | BaseException]


@dataclass(slots=True)
class Outbox:
    """What one iteration sends to the event loop, in order."""

    items: list[Reply | Delivery] = field(default_factory=list)

    def resolve(self, future: asyncio.Future[None], error: BaseException | None) -> None:
        self.items.append((future, error))

    def deliver(self, stream: RequestStream, item: RequestDelta | BaseException) -> None:
        self.items.append((stream, item))


def deliver_on_loop(items: list[Reply | Delivery]) -> None:
    """Runs on the event loop: resolve acceptance futures and feed streams, in order."""
    for target, item in items:
        if isinstance(target, RequestStream):
            assert item is not None
            target._put(item)
        elif target.done():
            continue  # the caller was cancelled meanwhile
        elif isinstance(item, BaseException):
            target.set_exception(item)
        else:
            target.set_result(None)
