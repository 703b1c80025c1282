"""The async engine: one background thread steps :class:`LLMEngine`; asyncio callers stream.

::

    event loop (HTTP handlers)                  engine thread (owns the LLMEngine)
    ---------------------------                 ------------------------------------
    await add_request() --- Add -------+
    RequestStream.close() - Abort -----+--> commands (thread-safe FIFO)
    abort_all(), shutdown()            |        |  drained between steps: a request
                                       |        v  added during step k joins step k+1
                                       |    engine.step() -> cumulative outputs
                                       |        |  -> per-request deltas (new text, ids)
    RequestStream (asyncio.Queue) <----+--- loop.call_soon_threadsafe(deliver, batch)

Invariants:

* Every ``LLMEngine`` call that reads or changes request state happens on the engine
  thread; other threads only put commands on the queue and read the immutable
  :class:`EngineStats` snapshot, which the engine thread swaps after each iteration.
  Statistics are gathered per step and folded in once per step (:class:`StepStats`)
  and once per ended request; nothing on the engine thread takes a lock for them.
* :meth:`from_options` builds the engine on the engine thread, and :meth:`warm_up` runs
  there too: every model computation happens on that one thread (a second thread with
  its own OpenMP pool slowed every CPU kernel about 2x, see ``engine/engine_thread.py``).
* The thread blocks on the command queue whenever the engine has no unfinished request
  (no busy-spinning), and drains every queued command before each step.
* A request ends exactly once, with a final delta (``finished=True``) or an exception
  delivered to its stream; aborting frees its KV blocks before the next step.
* Deltas and acceptance replies travel through ``call_soon_threadsafe`` in order, so a
  stream sees "accepted" before its first delta.

This module is the asyncio-facing API; the engine thread's side is its base class,
:class:`~inflight.engine.engine_loop.EngineLoop`, and the commands are in
``engine_commands.py``.

Load and faults:

* Backpressure: ``max_waiting_requests`` is enforced by ``LLMEngine.add_request`` on the
  engine thread, so concurrent adds can never push the queue past it; a refused add
  raises :class:`EngineOverloadedError` to its caller (counted, reason ``queue_full``).
* Deadlines: a request with a timeout (its own, or the engine's ``request_timeout``)
  that has not finished by arrival + timeout is aborted on the engine thread before the
  next step (its blocks freed) and its stream gets :class:`RequestTimeoutError`. Expired
  requests are found through a heap of deadlines checked every iteration; an idle
  thread waits on the command queue no longer than the earliest deadline.
* Health: a step that raises fails the requests in flight and the engine goes on;
  ``max_consecutive_step_failures`` failing steps in a row (a successful step resets
  the count) mark the engine unhealthy for good: ``is_healthy`` turns false (``/health``
  answers 503, so an orchestrator restarts the process) and new requests are refused
  with :class:`EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from inflight.engine.engine_commands import Abort, Add, ResetPrefixCache, Shutdown
from inflight.engine.engine_loop import EngineLoop, RequestTimeoutError
from inflight.engine.engine_thread import EngineThread
from inflight.engine.llm_engine import LLMEngine, PromptInput
from inflight.engine.request_stream import (
    EngineDeadError,
    EngineShutdownError,
    RequestDelta,
    RequestStream,
    StreamLimits,
)
from inflight.metrics.stats import EngineStats, StatObserver
from inflight.sampling_params import SamplingParams

__all__ = ["DEFAULT_MAX_CONSECUTIVE_STEP_FAILURES", "AsyncLLMEngine", "RequestTimeoutError"]

logger = logging.getLogger(__name__)

# Failing steps in a row after which the engine is marked unhealthy.
DEFAULT_MAX_CONSECUTIVE_STEP_FAILURES = 3


class AsyncLLMEngine(EngineLoop):
    """Serve many concurrent asyncio callers from one :class:`LLMEngine` on its own thread.

    Call :meth:`start` on the event loop that will consume the streams, then
    ``stream = await add_request(...)`` and ``async for delta in stream``.
    """

    def __init__(
        self,
        engine: LLMEngine,
        observers: Sequence[StatObserver] = (),
        *,
        request_timeout: float | None = None,
        max_consecutive_step_failures: int = DEFAULT_MAX_CONSECUTIVE_STEP_FAILURES,
        engine_thread: EngineThread | None = None,
    ) -> None:
        """``request_timeout``: seconds a request may take from arrival to its end unless
        it sets its own (None: no limit). ``max_consecutive_step_failures``: failing
        steps in a row that mark the engine unhealthy. ``engine_thread``: the thread that
        built ``engine`` (see :meth:`from_options`), to warm it up and step it on; one is
        started if None. An engine whose model already ran on another living thread
        still works, only its CPU kernels are slower (``engine/engine_thread.py``)."""
        if request_timeout is not None and not request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {request_timeout}")
        if max_consecutive_step_failures < 1:
            raise ValueError(
                f"max_consecutive_step_failures must be >= 1, got {max_consecutive_step_failures}"
            )
        self._request_timeout = request_timeout
        self._kv_cache_populated = False
        # How far a stream's reader may fall behind before its request is dropped.
        self.stream_limits = StreamLimits()
        self._engine_thread = engine_thread
        super().__init__(engine, observers, max_consecutive_step_failures)

    @classmethod
    def from_options(
        cls, model: str | None = None, *, request_timeout: float | None = None, **options: Any
    ) -> AsyncLLMEngine:
        """Build the engine on its own thread, where it will be warmed up and stepped
        (every model computation on one thread: see ``engine/engine_thread.py``)."""
        thread = EngineThread()
        try:
            engine = thread.call(lambda: LLMEngine.from_options(model, **options))
        except BaseException:
            thread.stop()  # no engine to step: let the thread end
            raise
        return cls(engine, request_timeout=request_timeout, engine_thread=thread)

    # ------------------------------------------------------------------ read-only facts

    @property
    def tokenizer(self) -> Any:
        return self._engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._engine.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._engine.eos_token_ids

    @property
    def max_logprobs(self) -> int:
        return self._engine.config.max_logprobs

    @property
    def model_path(self) -> str:
        return self._engine.model_path

    @property
    def default_sampling_params(self) -> dict[str, Any]:
        return self._engine.default_sampling_params

    @property
    def stats(self) -> EngineStats:
        return self._stats

    @property
    def is_healthy(self) -> bool:
        return (
            self._dead is None and self._unhealthy is None
            and self._thread is not None and self._thread.is_alive()
        )

    @property
    def health_error(self) -> str | None:
        """Why the engine is not healthy (None while it is)."""
        if self._unhealthy is not None:
            return self._unhealthy
        if self._dead is not None:
            return f"The engine has stopped: {self._dead!r}"
        if self._thread is None or not self._thread.is_alive():
            return "The engine is not running."
        return None

    def add_observer(self, observer: StatObserver) -> None:
        """Register before :meth:`start`; observers run on the engine thread."""
        self._observers.append(observer)

    def tokenize_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """Text and token ids of a prompt; safe off the engine thread (no request state)."""
        return self._engine.tokenize_prompt(prompt)

    # ------------------------------------------------------------------ lifecycle

    def warm_up(self) -> float:
        """Pay the first forward passes' one-off costs now (see :meth:`LLMEngine.warm_up`);
        call before :meth:`start`. Returns the seconds it took."""
        if self._thread is not None:
            raise RuntimeError("warm_up() must run before start()")
        started = time.monotonic()
        # Map the KV cache first: faulting in gigabytes later, beside the first clients'
        # steps, cost them seconds of TTFT on this project's VMs.
        self._kv_cache_populated = self._engine.populate_kv_cache()
        self._compute_thread().call(self._engine.warm_up)
        return time.monotonic() - started

    def _compute_thread(self) -> EngineThread:
        if self._engine_thread is None:
            self._engine_thread = EngineThread()
        return self._engine_thread

    def start(self) -> None:
        """Bind to the running event loop and start the engine thread."""
        if self._thread is not None:
            raise RuntimeError("the engine is already started")
        self._loop = asyncio.get_running_loop()
        thread = self._compute_thread()
        thread.run_last(self._run)
        self._thread = thread
        if not self._kv_cache_populated:
            # Map the KV cache in while idle, not on first requests (safe beside the engine).
            threading.Thread(target=self._engine.populate_kv_cache, daemon=True).start()

    async def shutdown(self) -> None:
        """Stop accepting, abort whatever is still in flight, and join the engine thread."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._commands.put(Shutdown())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    # ------------------------------------------------------------------ requests

    async def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        request_timeout: float | None = None,
    ) -> RequestStream:
        """Queue a request for the next step and wait until the engine has accepted it.

        ``request_timeout`` (seconds from ``arrival_time``, default the engine's) bounds
        the request's life: past it the request is aborted and its stream raises
        :class:`RequestTimeoutError`.

        Raises the engine's ``ValueError``/``TypeError`` for a request it rejects,
        :class:`EngineOverloadedError` when ``max_waiting_requests`` wait already,
        :class:`EngineShutdownError` while shutting down, :class:`EngineDeadError` if dead
        or unhealthy.
        """
        if request_timeout is not None and not request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {request_timeout}")
        loop = self._loop
        if loop is None:
            raise RuntimeError("call start() before add_request()")
        stream = RequestStream(request_id, self, self.stream_limits)
        accepted: asyncio.Future[None] = loop.create_future()
        command = Add(
            request_id,
            prompt,
            params,
            priority,
            arrival_time if arrival_time is not None else time.monotonic(),
            stream,
            accepted,
            request_timeout if request_timeout is not None else self._request_timeout,
        )
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(f"the engine has stopped: {self._dead!r}")
            if self._unhealthy is not None:
                raise EngineDeadError(self._unhealthy)
            if self._closed:
                raise EngineShutdownError("the server is shutting down")
            self._commands.put(command)
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # the caller left before the reply: don't leak it
            raise
        return stream

    async def generate(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams,
        *,
        priority: int = 0,
    ) -> AsyncIterator[RequestDelta]:
        """Convenience: add a request and yield its deltas; aborts it if the caller stops."""
        stream = await self.add_request(request_id, prompt, params, priority=priority)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe); its stream gets a final ``abort`` delta."""
        with self._lock:
            if not self._closed:
                self._commands.put(Abort([request_id]))

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block, on the engine thread between steps; False
        (nothing changed) while any request holds KV blocks."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("call start() before reset_prefix_cache()")
        command = ResetPrefixCache(loop.create_future())
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(f"the engine has stopped: {self._dead!r}")
            if self._closed:
                raise EngineShutdownError("the server is shutting down")
            self._commands.put(command)
        await command.done
        return command.result

    def abort_all(self) -> None:
        """Abort every request in flight (used when a graceful-shutdown grace period ends)."""
        with self._lock:
            if not self._closed:
                self._commands.put(Abort(None))
