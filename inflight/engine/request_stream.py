"""What an asyncio caller holds for one request: its stream of deltas, and the errors.

A :class:`RequestStream` is fed by the engine thread (through the event loop) and read
with ``async for``; closing it before the end aborts the request.

Slow consumers: the engine never waits for a reader, so a client that stops reading (its
TCP buffers full, the HTTP send blocked) leaves deltas piling up in its stream. Past a
bound (:class:`StreamLimits`: too many undelivered deltas, or nothing read for too long
while deltas wait) the stream is *dropped*: the request is aborted (its KV blocks freed
before the next step), the undelivered deltas are discarded, and the reader, if it ever
comes back, gets :class:`StreamDroppedError`. vLLM has no such bound.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Protocol

from inflight.outputs import PromptLogprobs, SampleLogprobs

logger = logging.getLogger(__name__)

# A reader this far behind is gone for practical purposes. 4096 deltas is ~1 MB of SSE,
# well above what one step sends a request (n <= 128 deltas) and what TCP buffers absorb.
MAX_UNDELIVERED_DELTAS = 4096
# Deltas waiting this long with nothing read: the client stopped reading.
MAX_STREAM_STALL_S = 60.0


class _Aborter(Protocol):
    def abort(self, request_id: str) -> None: ...


class EngineDeadError(RuntimeError):
    """The engine failed while the request was in flight, or has stopped for good."""


class RequestFailedError(EngineDeadError):
    """This request alone failed during a step (finish_reason "error"); the engine and
    the other requests go on. A subclass of EngineDeadError so that callers that report
    an engine failure for their request (a 500, or an SSE error event) report this too."""


class EngineUnavailableError(EngineDeadError):
    """The engine replica serving the request died (data-parallel serving): the service
    goes on, so the server answers 503 (retry) rather than 500."""


class EngineShutdownError(RuntimeError):
    """The engine is shutting down and accepts no new requests."""


class StreamDroppedError(RuntimeError):
    """The reader fell too far behind its stream (see :class:`StreamLimits`); the request
    was aborted and its undelivered output discarded."""


@dataclass(frozen=True, slots=True)
class StreamLimits:
    """How far a stream's reader may fall behind before the request is dropped."""

    max_undelivered_deltas: int = MAX_UNDELIVERED_DELTAS
    max_stall_s: float = MAX_STREAM_STALL_S  # deltas waiting, none read for this long


@dataclass(frozen=True, slots=True)
class RequestDelta:
    """What one completion (``index``) of a request produced since its previous delta.

    With ``n > 1`` the completions' deltas interleave; ``finish_reason`` is set on a
    completion's last delta and ``finished`` on the request's very last delta.
    """

    request_id: str
    text: str  # new text only
    token_ids: list[int]  # new token ids only
    num_prompt_tokens: int
    num_output_tokens: int  # cumulative
    finished: bool
    finish_reason: str | None = None  # "stop", "length" or "abort" once finished
    stop_reason: int | str | None = None  # the stop token id or stop string, if any
    index: int = 0  # which of the n completions
    logprobs: SampleLogprobs | None = None  # the new tokens' logprobs, when asked for
    cumulative_logprob: float | None = None
    # The prompt's logprobs (first entry None), on the request's first delta only.
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class RequestStream:
    """The deltas of one request, read with ``async for`` on the event loop.

    ``close()`` aborts the request if it has not finished (a client went away); it is
    idempotent and safe to call from ``finally`` blocks. Everything here runs on the
    event loop (the engine thread feeds ``_put`` through ``call_soon_threadsafe``).
    """

    def __init__(
        self, request_id: str, engine: _Aborter, limits: StreamLimits | None = None
    ) -> None:
        self.request_id = request_id
        self.finished = False
        self.dropped = False  # the reader fell behind past ``limits``; see the module doc
        self._engine = engine
        self._limits = limits or StreamLimits()
        self._queue: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()
        self._done = False  # the final item has been handed out
        self._waiting_since: float | None = None  # undelivered items, none read since

    def _put(self, item: RequestDelta | BaseException) -> None:
        if self.dropped:
            return  # the engine's abort reply, or deltas sent before it landed
        if self._queue.empty():
            self._waiting_since = time.monotonic()
        self._queue.put_nowait(item)
        final = isinstance(item, BaseException) or item.finished
        if not final and self._reader_is_behind():
            self._drop()

    def _reader_is_behind(self) -> bool:
        limits = self._limits
        if self._queue.qsize() > limits.max_undelivered_deltas:
            return True
        waited = time.monotonic() - (self._waiting_since or time.monotonic())
        return waited > limits.max_stall_s

    def _drop(self) -> None:
        """Abort the request, discard what is undelivered, leave the reader an error."""
        logger.warning(
            "dropping request %s: its reader fell behind (%d undelivered deltas)",
            self.request_id,
            self._queue.qsize(),
        )
        self.dropped = True
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(StreamDroppedError(
            f"request {self.request_id} was aborted: its client stopped reading the stream "
            f"(more than {self._limits.max_undelivered_deltas} undelivered deltas, or none "
            f"read for {self._limits.max_stall_s:.0f} s)"
        ))
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        self._waiting_since = None if self._queue.empty() else time.monotonic()
        if isinstance(item, BaseException):
            self._done = self.finished = True
            raise item
        if item.finished:
            self._done = self.finished = True
        return item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)
