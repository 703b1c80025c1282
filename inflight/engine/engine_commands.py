"""The commands the asyncio-facing API of :class:`~inflight.engine.async_engine.AsyncLLMEngine`
puts on the engine thread's queue (:class:`~inflight.engine.engine_loop.EngineLoop`
drains it between steps). Plain records: the engine thread replies through their futures.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from inflight.engine.llm_engine import PromptInput
from inflight.engine.request_stream import RequestStream
from inflight.sampling_params import SamplingParams


@dataclass(slots=True)
class Add:
    request_id: str
    prompt: PromptInput
    params: SamplingParams
    priority: int
    arrival_time: float
    stream: RequestStream
    accepted: asyncio.Future[None]
    timeout_s: float | None = None  # the request's deadline is arrival_time + timeout_s


@dataclass(slots=True)
class Abort:
    request_ids: list[str] | None  # None: every request in flight


@dataclass(slots=True)
class ResetPrefixCache:
    done: asyncio.Future[None]
    result: bool = False  # set on the engine thread before ``done`` resolves


@dataclass(slots=True)
class Shutdown:
    pass


Command = Add | Abort | ResetPrefixCache | Shutdown
