"""One engine replica: an :class:`AsyncLLMEngine` inside a Ray actor (its own process).

The class is plain Python; :func:`replica_actor_class` wraps it with ``ray.remote`` so
this module imports without ray. Every method is ``async``: Ray runs them on the actor's
event loop, the loop the engine thread delivers to.

Two channels to the client::

    client --add(request)--> replica: ACCEPTED or Rejected (the engine's acceptance reply,
                                      so the client raises the ValueError a local engine would)
    client <--outputs()----- replica: one long-lived Ray streaming generator; each item is
                                      a list of (request_id, RequestDelta | Failed): every
                                      delta that was ready, from all requests together

Batching every ready delta into one Ray item (rather than one item per token of each
request) is what keeps the client's cost per request low: Ray costs about a millisecond
of driver CPU per streamed item. A request's deltas keep their order; its last one is
``finished``, or a :class:`Failed` when the engine failed it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from inflight.engine.async_engine import AsyncLLMEngine, RequestTimeoutError
from inflight.engine.llm_engine import EngineOverloadedError, PromptInput
from inflight.engine.request_stream import (
    EngineDeadError,
    EngineShutdownError,
    RequestDelta,
    RequestStream,
)
from inflight.metrics.stats import EngineStats
from inflight.sampling_params import SamplingParams

ACCEPTED = "accepted"


@dataclass(frozen=True, slots=True)
class Rejected:
    """The engine refused the request (``error_type`` is ValueError or TypeError), or
    could not take it (``unavailable``: shutting down or dead)."""

    error_type: str
    message: str
    unavailable: bool = False
    # EngineOverloadedError's counts: (requests waiting, max_waiting_requests).
    overloaded: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class Failed:
    """The engine failed the request after accepting it."""

    message: str
    timeout_s: float | None = None  # set when it passed its deadline (a 504)


ReplicaItem = RequestDelta | Failed


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """What the client needs to know about the model the replicas serve."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_logprobs: int
    model_path: str
    default_sampling_params: dict[str, Any]
    block_size: int
    enable_prefix_caching: bool
    pid: int


class EngineReplica:
    """Owns one engine; ``num_threads`` torch threads (its share of the cores)."""

    def __init__(self, model: str | None, options: dict[str, Any], num_threads: int) -> None:
        import torch

        torch.set_num_threads(max(1, num_threads))
        options = dict(options)
        warmup = options.pop("warmup", False)  # the server's start-up dummy run, per replica
        self._engine = AsyncLLMEngine.from_options(model, **options)
        if warmup:
            self._engine.warm_up()
        self._started = False
        self._streams: dict[str, RequestStream] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._outbox: asyncio.Queue[tuple[str, ReplicaItem]] = asyncio.Queue()

    def _ensure_started(self) -> AsyncLLMEngine:
        # start() binds the engine to the running loop: only possible inside a method.
        if not self._started:
            self._engine.start()
            self._started = True
        return self._engine

    async def describe(self) -> ReplicaInfo:
        engine = self._ensure_started()
        cache = engine._engine.config.cache
        return ReplicaInfo(
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
            eos_token_ids=engine.eos_token_ids,
            max_logprobs=engine.max_logprobs,
            model_path=engine.model_path,
            default_sampling_params=engine.default_sampling_params,
            block_size=cache.block_size,
            enable_prefix_caching=cache.enable_prefix_caching,
            pid=os.getpid(),
        )

    async def tokenizer(self) -> Any:
        return self._engine.tokenizer

    async def add(
        self, request_id: str, prompt: PromptInput, params: SamplingParams, priority: int,
        request_timeout: float | None = None,
    ) -> str | Rejected:
        """Add a request; its deltas go to :meth:`outputs`. ACCEPTED or why not."""
        engine = self._ensure_started()
        try:
            stream = await engine.add_request(
                request_id, prompt, params, priority=priority, request_timeout=request_timeout
            )
        except EngineOverloadedError as error:
            counts = (error.num_waiting, error.max_waiting_requests)
            return Rejected(type(error).__name__, str(error), overloaded=counts)
        except (ValueError, TypeError) as error:
            return Rejected(type(error).__name__, str(error))
        except (EngineShutdownError, EngineDeadError) as error:
            return Rejected(type(error).__name__, str(error), unavailable=True)
        self._streams[request_id] = stream
        task = asyncio.get_running_loop().create_task(self._forward(stream))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return ACCEPTED

    async def _forward(self, stream: RequestStream) -> None:
        try:
            async for delta in stream:
                self._outbox.put_nowait((stream.request_id, delta))
        except EngineDeadError as error:
            timeout_s = error.timeout_s if isinstance(error, RequestTimeoutError) else None
            self._outbox.put_nowait((stream.request_id, Failed(str(error), timeout_s)))
        finally:
            self._streams.pop(stream.request_id, None)
            stream.close()

    async def outputs(self) -> AsyncIterator[list[tuple[str, ReplicaItem]]]:
        """Every request's deltas, in batches of whatever is ready (never empty)."""
        self._ensure_started()
        while True:
            batch = [await self._outbox.get()]
            while not self._outbox.empty():
                batch.append(self._outbox.get_nowait())
            yield batch

    async def abort(self, request_id: str) -> None:
        self._ensure_started().abort(request_id)

    async def abort_all(self) -> None:
        self._ensure_started().abort_all()

    async def reset_prefix_cache(self) -> bool:
        return await self._ensure_started().reset_prefix_cache()

    async def heartbeat(self) -> tuple[int, EngineStats]:
        """This process's id (a new one after a restart) and the latest stats snapshot,
        made picklable (histograms as a plain dict)."""
        stats = self._ensure_started().stats
        return os.getpid(), dataclasses.replace(stats, histograms=dict(stats.histograms))

    async def is_healthy(self) -> bool:
        return self._ensure_started().is_healthy

    async def shutdown(self) -> None:
        if self._started:
            await self._engine.shutdown()


def replica_actor_class(num_cpus: float, num_gpus: float, max_restarts: int) -> Any:
    """:class:`EngineReplica` as a Ray actor class; Ray restarts a dead one (re-running
    ``__init__``), and never retries a call that was in flight when it died. Async
    methods make it an async actor (up to 1000 concurrent calls by default)."""
    import ray

    return ray.remote(
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        max_restarts=max_restarts,
        max_task_retries=0,
    )(EngineReplica)
