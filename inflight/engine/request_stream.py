"""What an asyncio caller holds for one request: its stream of deltas, and the errors.

A :class:`RequestStream` is fed by the engine thread (through the event loop) and read
with ``async for``; closing it before the end aborts the request.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from inflight.outputs import PromptLogprobs, SampleLogprobs


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
    idempotent and safe to call from ``finally`` blocks.
    """

    def __init__(self, request_id: str, engine: _Aborter) -> None:
        self.request_id = request_id
        self.finished = False
        self._engine = engine
        self._queue: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()
        self._done = False  # the final item has been handed out

    def _put(self, item: RequestDelta | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
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
