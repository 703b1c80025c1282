"""Data-parallel serving: N engine replicas in Ray actors behind one engine client.

::

    HTTP handlers (event loop) --add_request--> DataParallelEngineClient
        Router.choose(prompt ids) -> replica r (least outstanding tokens / prefix affinity)
        replica r .add(request)  -> ACCEPTED / Rejected            (one Ray call)
    reader task per replica: replica .outputs() (one Ray streaming generator) yields
        batches of (request_id, delta) -> each request's RequestStream
    health task: polls every replica's heartbeat; a dead one is out of rotation until it
        answers again (Ray restarts it: ``max_restarts``)

:class:`DataParallelEngineClient` has :class:`~inflight.engine.protocol.EngineClient`'s
interface, so the OpenAI serving code drives it exactly as it drives one
:class:`AsyncLLMEngine`.

Failures: when a replica dies, the router takes it out of rotation. Each of its requests
that had streamed nothing yet (accepted or not) is retried once on another replica; one
that had streamed something ends with :class:`EngineUnavailableError` (the server's 503,
or an SSE error event). With no replica alive, new requests get ``EngineDeadError`` (503).

Invariants: a request is in ``_in_flight`` from :meth:`add_request` until its stream got
its last item (a final delta or an error), and is ended in the router then, exactly
once; deltas reach a stream in the order its replica produced them, and only from the
replica the request runs on now (``_InFlight.replica``; a stale one is dropped).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from inflight.distributed.metrics import DataParallelMetrics, ReplicaSnapshot
from inflight.distributed.ray_utils import (
    RAY_MISSING,
    DataParallelConfig,
    error_cause,
    error_reason,
    gpus_per_replica,
    import_ray,
    init_ray,
)
from inflight.distributed.replica import (
    ACCEPTED,
    Failed,
    Rejected,
    ReplicaInfo,
    ReplicaItem,
    replica_actor_class,
)
from inflight.distributed.router import NoReplicaAliveError, Router, RouterConfig
from inflight.engine.async_engine import RequestTimeoutError
from inflight.engine.llm_engine import EngineOverloadedError, PromptInput
from inflight.engine.request_stream import (
    EngineDeadError,
    EngineShutdownError,
    EngineUnavailableError,
    RequestDelta,
    RequestStream,
)
from inflight.metrics.stats import EngineStats
from inflight.sampling_params import SamplingParams

__all__ = [
    "RAY_MISSING",
    "DataParallelConfig",
    "DataParallelEngineClient",
    "gpus_per_replica",
    "import_ray",
    "init_ray",
]

logger = logging.getLogger(__name__)

@dataclass(slots=True)
class _ReplicaState:
    handle: Any
    pid: int = 0  # the actor's process; a new one means Ray restarted it
    epoch: int = 0  # deaths seen: a reply from before one is stale
    alive: bool = True
    num_restarts: int = 0
    stats: EngineStats | None = None
    last_error: str | None = None


@dataclass(slots=True)
class _InFlight:
    """One request the client owns: where it runs, and whether it may be retried."""

    request_id: str
    prompt: PromptInput
    prompt_token_ids: list[int]
    cache_salt: str | None
    params: SamplingParams
    priority: int
    stream: RequestStream
    request_timeout: float | None = None  # seconds, enforced by the replica's engine
    replica: int = -1
    accepted: bool = False  # by ``replica``; until then _submit handles its failures
    streamed: bool = False  # a delta reached the caller: no retry any more
    tried: set[int] = field(default_factory=set)


class DataParallelEngineClient:
    """N replicas of one model as Ray actors, routed by :class:`Router`."""

    def __init__(
        self, model: str | None, engine_options: dict[str, Any], config: DataParallelConfig
    ) -> None:
        ray = import_ray()
        self._ray = ray
        self.config = config
        self._started_ray = init_ray(ray, config)
        actor_class = replica_actor_class(
            num_cpus=config.num_cpus_per_replica,
            num_gpus=gpus_per_replica(ray, str(engine_options.get("device") or "auto"), config),
            max_restarts=config.max_restarts,
        )
        self._replicas = [
            _ReplicaState(actor_class.remote(model, engine_options, config.torch_threads))
            for _ in range(config.data_parallel_size)
        ]
        infos = self._wait_ready()
        self._info = infos[0]
        for replica, info in zip(self._replicas, infos, strict=True):
            replica.pid = info.pid
        self._tokenizer = ray.get(self._replicas[0].handle.tokenizer.remote())
        self.router = Router(
            RouterConfig(
                num_replicas=config.data_parallel_size,
                block_size=self._info.block_size,
                enable_prefix_affinity=self._info.enable_prefix_caching,
                affinity_blocks=config.affinity_blocks,
                affinity_slack_tokens=config.affinity_slack_tokens,
            )
        )
        self._in_flight: dict[str, _InFlight] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # readers, health, retries
        self._closed = False
        self.route_overhead_s = 0.0  # total time spent in Router.choose (bench)

    def _wait_ready(self) -> list[ReplicaInfo]:
        """Wait for every model to load (the server opens its port only when ready); a
        replica that cannot start stops everything with a one-line ValueError."""
        ray = self._ray
        try:
            infos: list[ReplicaInfo] = ray.get(
                [r.handle.describe.remote() for r in self._replicas]
            )
        except ray.exceptions.RayError as error:
            for replica in self._replicas:
                ray.kill(replica.handle, no_restart=True)
            if self._started_ray:
                ray.shutdown()
            raise ValueError(f"an engine replica failed to start: {error_cause(error)}") from None
        return infos

    # ------------------------------------------------------------------ read-only facts

    @property
    def replica_handles(self) -> list[Any]:
        return [r.handle for r in self._replicas]

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._info.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._info.eos_token_ids

    @property
    def max_logprobs(self) -> int:
        return self._info.max_logprobs

    @property
    def model_path(self) -> str:
        return self._info.model_path

    @property
    def default_sampling_params(self) -> dict[str, Any]:
        return self._info.default_sampling_params

    @property
    def is_healthy(self) -> bool:
        return not self._closed and any(r.alive for r in self._replicas)

    def snapshots(self) -> list[ReplicaSnapshot]:
        return [
            ReplicaSnapshot(
                replica=i,
                alive=r.alive,
                stats=r.stats,
                num_requests_routed=self.router.num_routed[i],
                outstanding_tokens=self.router.load(i),
                num_restarts=r.num_restarts,
            )
            for i, r in enumerate(self._replicas)
        ]

    def health_report(self) -> tuple[bool, dict[str, Any]]:
        replicas = [
            {
                "replica": s.replica,
                "state": "alive" if s.alive else "dead",
                "num_requests_routed": s.num_requests_routed,
                "outstanding_tokens": s.outstanding_tokens,
                "num_restarts": s.num_restarts,
                "num_requests_running": s.stats.num_requests_running if s.stats else 0,
                "last_error": self._replicas[s.replica].last_error,
            }
            for s in self.snapshots()
        ]
        healthy = self.is_healthy
        num_alive = sum(r["state"] == "alive" for r in replicas)
        status = "ok" if num_alive == len(replicas) else "degraded" if healthy else "unavailable"
        return healthy, {"status": status, "replicas": replicas}

    def make_metrics(self, model_name: str) -> DataParallelMetrics:
        return DataParallelMetrics(self.snapshots, model_name)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start a reader task per replica and the health task, on the running loop."""
        for replica in range(len(self._replicas)):
            self._spawn(self._read_outputs(replica))
        self._spawn(self._watch_replicas())

    async def shutdown(self) -> None:
        """Stop accepting, end the requests still in flight (``abort``), and stop the
        replicas (and the local Ray cluster, if this client started it)."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await self._each_alive("shutdown")
        for flight in list(self._in_flight.values()):
            self._finish(flight, self._abort_delta(flight))
        for replica in self._replicas:
            self._ray.kill(replica.handle, no_restart=True)
        if self._started_ray:
            self._ray.shutdown()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)  # held: the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)

    @property
    def _lost_errors(self) -> tuple[type[BaseException], ...]:
        """What a call raises when its replica died (or is restarting)."""
        return (self._ray.exceptions.RayActorError,)

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
        """Route the request, and wait until a replica has accepted it (retrying once on
        another replica if the first dies before answering)."""
        del arrival_time  # each replica stamps arrivals on its own clock
        if self._closed:
            raise EngineShutdownError("the server is shutting down")
        if request_id in self._in_flight:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids, salt = self._prompt_tokens(prompt)
        stream = RequestStream(request_id, self)
        flight = _InFlight(
            request_id, prompt, token_ids, salt, params, priority, stream, request_timeout
        )
        # Registered first: its first deltas may come before the acceptance reply.
        self._in_flight[request_id] = flight
        try:
            await self._submit(flight)
        except BaseException:
            self._in_flight.pop(request_id, None)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        flight = self._in_flight.get(request_id)
        if flight is not None and flight.accepted and self._replicas[flight.replica].alive:
            self._replicas[flight.replica].handle.abort.remote(request_id)

    def abort_all(self) -> None:
        for replica in self._replicas:
            if replica.alive:
                replica.handle.abort_all.remote()

    async def reset_prefix_cache(self) -> bool:
        results = await self._each_alive("reset_prefix_cache")
        return all(results)

    # ------------------------------------------------------------------ routing

    def _prompt_tokens(self, prompt: PromptInput) -> tuple[list[int], str | None]:
        """The token ids the router hashes (the replica re-checks the prompt itself)."""
        if isinstance(prompt, dict):
            salt = prompt.get("cache_salt")
            if prompt.get("prompt_token_ids") is not None:
                return list(prompt["prompt_token_ids"]), salt
            return self._prompt_tokens(prompt.get("prompt", ""))[0], salt
        if isinstance(prompt, str):
            return list(self._tokenizer.encode(prompt)), None
        return list(prompt), None

    async def _submit(self, flight: _InFlight) -> None:
        """Add the request on a replica and wait for its acceptance. A replica that dies
        first is taken out of rotation and the request tried once more elsewhere."""
        while True:
            replica = self._route(flight)
            state = self._replicas[replica]
            epoch = state.epoch
            try:
                reply = await state.handle.add.remote(
                    flight.request_id, flight.prompt, flight.params, flight.priority,
                    flight.request_timeout,
                )
            except self._lost_errors as error:
                self._replica_died(replica, error_reason(error))
                reply = None
            except BaseException:  # cancelled (the caller left): don't leak it there
                self.router.end(flight.request_id)
                state.handle.abort.remote(flight.request_id)
                raise
            if reply is not None and state.epoch != epoch:
                reply = None  # accepted, but the replica died before we saw the reply
            if reply is None:
                if len(flight.tried) >= 2:
                    raise EngineUnavailableError(
                        f"engine replica {replica} died before accepting the request"
                    )
                continue
            if isinstance(reply, Rejected):
                self.router.end(flight.request_id)
                raise _rejection_error(reply)
            assert reply == ACCEPTED, reply
            flight.accepted = True
            return

    def _route(self, flight: _InFlight) -> int:
        started = time.perf_counter()
        try:
            decision = self.router.choose(
                flight.prompt_token_ids, flight.cache_salt, exclude=frozenset(flight.tried)
            )
        except NoReplicaAliveError as error:
            raise EngineDeadError("no engine replica is alive; retry later") from error
        finally:
            self.route_overhead_s += time.perf_counter() - started
        params = flight.params
        max_tokens = params.max_tokens if params.max_tokens is not None else 256
        self.router.begin(
            flight.request_id, decision.replica, len(flight.prompt_token_ids),
            params.n * max_tokens,
        )
        flight.replica = decision.replica
        flight.accepted = False
        flight.tried.add(decision.replica)
        return decision.replica

    # ------------------------------------------------------------------ outputs

    async def _read_outputs(self, replica: int) -> None:
        """Feed replica ``replica``'s deltas to their streams, for as long as we serve;
        after its death, listen again (Ray queues the call until it has restarted)."""
        while not self._closed:
            handle = self._replicas[replica].handle
            try:
                async for ref in handle.outputs.options(num_returns="streaming").remote():
                    for request_id, item in await ref:
                        self._dispatch(replica, request_id, item)
            except self._lost_errors as error:
                self._replica_died(replica, error_reason(error))
                await asyncio.sleep(self.config.health_check_interval_s)

    def _dispatch(self, replica: int, request_id: str, item: ReplicaItem) -> None:
        flight = self._in_flight.get(request_id)
        if flight is None or flight.replica != replica:
            return  # ended already, or retried elsewhere
        if isinstance(item, Failed):
            failure = (
                RequestTimeoutError(item.timeout_s) if item.timeout_s is not None
                else EngineDeadError(item.message)
            )
            self._finish(flight, failure)
            return
        flight.streamed = True
        self.router.progress(request_id, len(item.token_ids))
        flight.stream._put(item)
        if item.finished:
            self._finish(flight, None)

    def _finish(self, flight: _InFlight, last: RequestDelta | BaseException | None) -> None:
        """End a request: its stream's last item (unless it was already given), and the
        router's count."""
        if self._in_flight.pop(flight.request_id, None) is None:
            return
        self.router.end(flight.request_id)
        if last is not None:
            flight.stream._put(last)

    def _abort_delta(self, flight: _InFlight) -> RequestDelta:
        return RequestDelta(
            request_id=flight.request_id, text="", token_ids=[],
            num_prompt_tokens=len(flight.prompt_token_ids), num_output_tokens=0,
            finished=True, finish_reason="abort",
        )

    async def _retry(self, flight: _InFlight) -> None:
        try:
            await self._submit(flight)
        except (EngineDeadError, ValueError, TypeError) as error:
            self._finish(flight, error)

    # ------------------------------------------------------------------ replica health

    def _replica_died(self, replica: int, reason: str) -> None:
        state = self._replicas[replica]
        if state.alive:
            logger.warning("engine replica %d is out of rotation: %s", replica, reason)
        state.alive = False
        state.last_error = reason
        state.epoch += 1
        self.router.mark_dead(replica)
        for flight in list(self._in_flight.values()):
            if flight.replica == replica and flight.accepted:
                self._recover(flight)

    def _recover(self, flight: _InFlight) -> None:
        """A request whose replica died: retried elsewhere if nothing was streamed."""
        flight.accepted = False
        if flight.stream.finished:  # the caller left: nothing to recover
            self._finish(flight, self._abort_delta(flight))
        elif flight.streamed or len(flight.tried) >= 2:
            self._finish(flight, EngineUnavailableError(
                f"engine replica {flight.replica} died while serving the request"
            ))
        else:
            self._spawn(self._retry(flight))

    async def _watch_replicas(self) -> None:
        """Poll every replica's stats; a dead one that answers again (Ray restarted it)
        is back in rotation."""
        while True:
            await asyncio.gather(*(self._poll(i) for i in range(len(self._replicas))))
            await asyncio.sleep(self.config.health_check_interval_s)

    async def _poll(self, replica: int) -> None:
        state = self._replicas[replica]
        try:
            pid, stats = await asyncio.wait_for(
                state.handle.heartbeat.remote(), self.config.health_check_timeout_s
            )
        except self._lost_errors as error:
            self._replica_died(replica, error_reason(error))
            return
        except TimeoutError:
            return  # busy or restarting: its own requests tell us if it died
        state.stats = stats
        if pid != state.pid:  # restarted, possibly before anyone saw it dead
            state.pid = pid
            state.num_restarts += 1
        if not state.alive and not self._closed:
            logger.info("engine replica %d is back in rotation", replica)
            state.alive = True
            self.router.mark_alive(replica)

    async def _each_alive(self, method: str) -> list[Any]:
        refs = [getattr(r.handle, method).remote() for r in self._replicas if r.alive]
        try:
            return list(await asyncio.gather(*refs))
        except self._ray.exceptions.RayError:
            return [False]


def _rejection_error(rejected: Rejected) -> Exception:
    if rejected.unavailable:
        return EngineUnavailableError(rejected.message)
    if rejected.error_type == "TypeError":
        return TypeError(rejected.message)
    if rejected.overloaded is not None:
        return EngineOverloadedError(*rejected.overloaded)
    return ValueError(rejected.message)
