"""The engine thread of :class:`~inflight.engine.async_engine.AsyncLLMEngine` (its base
class): the loop that drains the commands between steps, steps the :class:`LLMEngine`,
turns its outputs into per-request deltas, aborts requests past their deadline, counts
failing steps (health) and publishes the :class:`EngineStats` snapshot.

:class:`EngineLoop` owns the state both sides share: the command queue, and the lock that
guards closing it together with putting commands. Every method here runs on the engine
thread; the asyncio-facing API (``async_engine.py``) only puts commands and reads the
snapshot. The invariants are in ``async_engine.py``'s docstring.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import logging
import queue
import threading
import time
from collections.abc import Sequence

from inflight.core.request import RequestStatus
from inflight.engine.engine_commands import Abort, Add, Command, ResetPrefixCache, Shutdown
from inflight.engine.engine_thread import EngineThread
from inflight.engine.live_request import LiveRequest
from inflight.engine.llm_engine import EngineOverloadedError, LLMEngine
from inflight.engine.loop_delivery import Outbox, deliver_on_loop
from inflight.engine.request_stream import EngineDeadError, RequestDelta, RequestFailedError
from inflight.metrics.stats import (
    EngineStats,
    PrefixCacheStats,
    StatObserver,
    StatsRecorder,
    StepStats,
)
from inflight.outputs import RequestOutput

logger = logging.getLogger(__name__)
# The longest the idle engine thread waits in one go for a deadline (see _until_deadline).
_LONGEST_WAIT_S = 3600.0


class RequestTimeoutError(EngineDeadError):
    """The request did not finish within its deadline and was aborted (the server
    answers 504, or ends the stream with an error event). A subclass of
    :class:`EngineDeadError` so that every caller that reports a failed request reports
    this too."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            f"the request did not finish within its timeout of {timeout_s:g} s and was "
            "aborted (request_timeout)"
        )
        self.timeout_s = timeout_s


class EngineLoop:
    """Steps one :class:`LLMEngine` on its own thread, fed by a queue of commands."""

    def __init__(
        self,
        engine: LLMEngine,
        observers: Sequence[StatObserver],
        max_consecutive_step_failures: int,
    ) -> None:
        self._engine = engine
        self._max_step_failures = max_consecutive_step_failures
        self._step_failures = 0  # failing steps in a row
        self._unhealthy: str | None = None  # why, once marked unhealthy (never cleared)
        self._deadlines: list[tuple[float, str]] = []  # heap; stale entries skipped
        self._clock = time.monotonic  # a test may replace it to move time forward
        self._num_rejected_queue_full = 0
        self._num_timeouts = 0
        self._observers: list[StatObserver] = list(observers)
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _closed together with putting commands
        self._closed = False
        self._dead: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: EngineThread | None = None  # set once the loop is queued on it
        self._live: dict[str, LiveRequest] = {}
        self._unscheduled: dict[str, LiveRequest] = {}  # accepted, never scheduled yet
        self._recorder = StatsRecorder(engine.max_model_len)
        self._cache_config_info = _cache_config_info(engine)
        self._num_steps = 0
        self._stats = EngineStats()
        self._publish_stats()  # every family is there before the first request

    def _run(self) -> None:
        try:
            self._loop_forever()
        except BaseException as error:  # noqa: BLE001 - anything here kills the thread
            logger.exception("the engine thread died")
            self._die(error)

    def _loop_forever(self) -> None:
        while True:
            outbox = Outbox()
            idle = not self._engine.has_unfinished_requests()
            for command in self._next_commands(block=idle, timeout=self._until_deadline()):
                if isinstance(command, Shutdown):
                    self._abort_live(None, outbox)
                    self._publish_stats()
                    self._send(outbox)
                    return
                self._apply(command, outbox)
            if self._deadlines:
                self._expire(outbox)
            if self._engine.has_unfinished_requests():
                self._step(outbox)
            # Publish first: a client that has its final delta finds it in /metrics.
            self._publish_stats()
            self._send(outbox)

    def _next_commands(self, block: bool, timeout: float | None = None) -> list[Command]:
        """Everything queued now; when idle, first wait for one command (at most
        ``timeout`` seconds, so that a deadline is noticed)."""
        commands: list[Command] = []
        if block:
            try:
                commands.append(self._commands.get(timeout=timeout))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _until_deadline(self) -> float | None:
        """Seconds until the earliest pending deadline (None: none pending), at most an
        hour: a queue's wait overflows past ``threading.TIMEOUT_MAX`` (~9.2e9 s), and a
        client may ask for any timeout (waking early only rechecks the deadlines)."""
        if not self._deadlines:
            return None
        return min(_LONGEST_WAIT_S, max(0.0, self._deadlines[0][0] - self._clock()))

    def _expire(self, outbox: Outbox) -> None:
        """Abort every request past its deadline (engine thread, between steps)."""
        now = self._clock()
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, request_id = heapq.heappop(self._deadlines)
            live = self._live.get(request_id)
            if live is None or live.timeout_s is None:
                continue  # ended already: a stale entry
            if live.arrival_time + live.timeout_s != deadline:
                continue  # an id reused by a later request with its own deadline
            logger.info("request %s timed out after %g s", request_id, live.timeout_s)
            self._num_timeouts += 1
            self._end(request_id, "abort", outbox, RequestTimeoutError(live.timeout_s))
        if not self._live:
            self._deadlines.clear()

    def _apply(self, command: Add | Abort | ResetPrefixCache, outbox: Outbox) -> None:
        if isinstance(command, Abort):
            self._abort_live(command.request_ids, outbox)
            return
        if isinstance(command, ResetPrefixCache):
            command.result = self._engine.reset_prefix_cache()
            outbox.resolve(command.done, None)
            return
        if self._unhealthy is not None:  # queued before the engine was marked unhealthy
            outbox.resolve(command.accepted, EngineDeadError(self._unhealthy))
            return
        try:
            self._engine.add_request(
                command.request_id,
                command.prompt,
                command.params,
                arrival_time=command.arrival_time,
                priority=command.priority,
                # Per-step outputs for every request: streams need them, and the token
                # counters and TTFT stay exact for non-streaming requests too.
                stream=True,
            )
        except Exception as error:  # the request's own fault: reply, change nothing
            if isinstance(error, EngineOverloadedError):
                self._num_rejected_queue_full += 1
            outbox.resolve(command.accepted, error)
            return
        request = self._engine.get_request(command.request_id)
        stops = command.params.stop or []
        n = command.params.n
        live = LiveRequest(
            stream=command.stream,
            request=request,
            num_prompt_tokens=request.num_prompt_tokens,
            arrival_time=command.arrival_time,
            holdback=max((len(s) for s in stops), default=1) - 1,
            n=n, sent_token_counts=[0] * n, sent_char_counts=[0] * n, ended=[False] * n,
            timeout_s=command.timeout_s,
        )
        if command.timeout_s is not None:
            deadline = command.arrival_time + command.timeout_s
            heapq.heappush(self._deadlines, (deadline, command.request_id))
        self._live[command.request_id] = live
        self._unscheduled[command.request_id] = live
        outbox.resolve(command.accepted, None)

    def _step(self, outbox: Outbox) -> None:
        started = time.monotonic()
        try:
            outputs = self._engine.step()
        except Exception as error:
            # Fail the requests in flight (their clients get an error, not a hang) and
            # keep serving: the scheduler state is consistent once they are aborted.
            logger.exception("engine step failed; failing %d request(s)", len(self._live))
            failure = EngineDeadError(f"the engine failed during a step: {error!r}")
            for request_id in list(self._live):
                self._end(request_id, "error", outbox, failure)
            self._on_step_failure(error)
            return
        self._step_failures = 0
        self._num_steps += 1
        if self._unscheduled:
            self._note_scheduled(started)
        step = StepStats(time=time.monotonic())
        for output in outputs:
            self._on_output(output, step, outbox)
        if step.num_generation_tokens:
            self._recorder.record_step(step)

    def _on_step_failure(self, error: Exception) -> None:
        """Count a failing step; too many in a row mark the engine unhealthy for good."""
        self._step_failures += 1
        if self._step_failures >= self._max_step_failures and self._unhealthy is None:
            self._unhealthy = (
                f"The engine is unhealthy: {self._step_failures} consecutive steps failed "
                f"(last: {error!r}); restart the server."
            )
            logger.error("%s", self._unhealthy)

    def _note_scheduled(self, step_started: float) -> None:
        """Stamp the requests this step admitted: their queue time ends at its start."""
        for request_id, live in list(self._unscheduled.items()):
            if live.request.status is not RequestStatus.WAITING:
                live.first_scheduled_time = step_started
                del self._unscheduled[request_id]

    def _on_output(self, output: RequestOutput, step: StepStats, outbox: Outbox) -> None:
        live = self._live.get(output.request_id)
        if live is None:
            return  # aborted between the step's start and now
        for completion in output.outputs:
            if completion.finish_reason == "error":  # this request alone failed
                failure = RequestFailedError(f"the request failed: {completion.error}")
                self._end(output.request_id, "error", outbox, failure)
                return
        new_total = sum(
            len(c.token_ids) - live.sent_token_counts[c.index] for c in output.outputs
        )
        if new_total:
            if live.last_token_time is None:
                live.first_token_time = step.time
                step.first_token(
                    live.num_prompt_tokens, new_total, live.arrival_time,
                    live.request.num_cached_tokens or 0,
                )
            else:
                step.next_tokens(new_total, live.last_token_time)
            live.last_token_time = step.time
        deltas = [
            d for c in output.outputs
            if (d := live.delta(output, c)) is not None
        ]
        if output.finished:
            if not deltas:  # nothing new: still end the stream with a final delta
                deltas = [live.delta(output, output.outputs[-1], force=True)]  # type: ignore[list-item]
            *rest, last = deltas
            for delta in rest:
                outbox.deliver(live.stream, delta)
            final = dataclasses.replace(last, finished=True)
            reason = next((c.finish_reason for c in output.outputs if c.finish_reason), "stop")
            self._end(output.request_id, reason or "stop", outbox, final)
        else:
            for delta in deltas:
                outbox.deliver(live.stream, delta)

    def _abort_live(self, request_ids: list[str] | None, outbox: Outbox) -> None:
        for request_id in list(self._live) if request_ids is None else request_ids:
            live = self._live.get(request_id)
            if live is None:
                continue  # finished already, or never accepted
            final = RequestDelta(
                request_id=request_id,
                text="",
                token_ids=[],
                num_prompt_tokens=live.num_prompt_tokens,
                num_output_tokens=live.sent_tokens,
                finished=True,
                finish_reason="abort",
            )
            self._end(request_id, "abort", outbox, final)

    def _end(
        self, request_id: str, reason: str, outbox: Outbox, final: RequestDelta | BaseException
    ) -> None:
        """Forget a request: free its blocks (no-op if the engine ended it), report, notify."""
        live = self._live.pop(request_id)
        self._unscheduled.pop(request_id, None)
        if reason in ("abort", "error"):
            try:
                self._engine.abort_request(request_id)
            except Exception:  # after a failed step; the request must still end
                logger.exception("aborting %s failed", request_id)
        outbox.deliver(live.stream, final)
        stats = live.finished_stats(reason, time.monotonic())
        self._recorder.record_finished(stats)
        for observer in self._observers:
            try:
                observer.on_request_finished(stats)
            except Exception:  # metrics must never take the engine down
                logger.exception("stat observer %r failed", observer)

    def _send(self, outbox: Outbox) -> None:
        if not outbox.items or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(deliver_on_loop, outbox.items)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _publish_stats(self) -> None:
        scheduler = self._engine.scheduler
        kv_cache = self._engine.kv_cache
        recorder = self._recorder
        self._stats = EngineStats(
            num_requests_running=scheduler.num_running,
            num_requests_waiting=scheduler.num_waiting,
            kv_cache_usage=kv_cache.usage,
            num_kv_blocks_used=kv_cache.pool.num_used_blocks,
            num_kv_blocks_total=kv_cache.num_blocks,
            num_preemptions_total=scheduler.num_preemptions,
            prompt_tokens_total=recorder.prompt_tokens_total,
            prompt_tokens_cached_total=recorder.prompt_tokens_cached_total,
            generation_tokens_total=recorder.generation_tokens_total,
            num_steps_total=self._num_steps,
            num_requests_deferred=self._engine.structured_output.num_compiling,
            prefix_cache=PrefixCacheStats(
                queries=kv_cache.prefix_stats.queries, hits=kv_cache.prefix_stats.hits
            ),
            request_success=recorder.request_success,
            histograms=recorder.histogram_snapshots(),
            cache_config_info=self._cache_config_info,
            num_rejected_queue_full_total=self._num_rejected_queue_full,
            num_request_timeouts_total=self._num_timeouts,
        )

    def _die(self, error: BaseException) -> None:
        """The thread is going away: fail everything in flight and everything queued."""
        with self._lock:
            self._dead = error
            self._closed = True
        failure = EngineDeadError(f"the engine has stopped: {error!r}")
        outbox = Outbox()
        for live in self._live.values():
            outbox.deliver(live.stream, failure)
        self._live.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, Add):
                outbox.resolve(command.accepted, failure)
        self._send(outbox)


def _cache_config_info(engine: LLMEngine) -> tuple[tuple[str, str], ...]:
    """vLLM's ``cache_config_info`` labels that inflight has, valued as vLLM writes them."""
    cache = engine.config.cache
    return (
        ("block_size", str(cache.block_size)),
        ("cache_dtype", cache.cache_dtype),
        ("enable_prefix_caching", str(cache.enable_prefix_caching)),
        ("kv_cache_memory_bytes", str(cache.kv_cache_memory_bytes)),
        ("num_gpu_blocks", str(engine.kv_cache.num_blocks)),  # vLLM's name on every device
        ("num_gpu_blocks_override", str(cache.num_kv_blocks)),
    )
