"""The iteration-level scheduler (vLLM V1 shape), pure Python.

Each call to :meth:`Scheduler.schedule` plans one step under a token budget:

1. serve running requests first, each advancing ``num_computed_tokens`` toward its token
   count (a decode is one token, a prompt may be a chunk of many; a long prompt may be
   capped or held to a later step, :class:`PrefillCap`);
2. when the KV pool cannot grow a request's block table, preempt the lowest-priority,
   latest-arriving running request (free its blocks, back to the head of ``waiting``,
   recomputed later). Arrival is the order requests were added (the FCFS queue's
   order), not the order they were last admitted: a request resumed after a preemption
   is re-admitted at the end of ``running`` but keeps its place, so the oldest request
   is never the victim while another runs and always progresses (no livelock of a
   resumed request preempted again before it gains a token);
3. only if nothing was preempted and budget remains, admit waiting requests, each
   starting after the longest prefix of its tokens already in the KV cache (prefix
   caching, owned by :class:`KVCacheManager`), so only the rest costs budget.

:meth:`Scheduler.update_from_output` then appends sampled tokens, applies stop
conditions, registers blocks that became full in the prefix cache, and frees finished
requests' blocks at once.

A :class:`ReadinessCheck` may hold waiting requests back without the scheduler knowing
why (the engine's: a request whose structured-output grammar is still compiling); the
others are admitted past them.
"""

from __future__ import annotations

from typing import Protocol

from inflight.config import SchedulerConfig
from inflight.core.batching import make_batching_policy
from inflight.core.interface import (
    ModelRunnerOutput,
    RequestUpdate,
    ScheduledRequest,
    SchedulerOutput,
)
from inflight.core.kv_cache_manager import KVCacheManager
from inflight.core.prefill_cap import PrefillCap, StepPrefills
from inflight.core.request import Request, RequestStatus
from inflight.core.request_queue import make_request_queue
from inflight.core.slots import SlotTable
from inflight.sampling_params import InvalidRequestError


class ReadinessCheck(Protocol):
    def is_ready(self, request: Request) -> bool:
        """False while ``request`` may not be admitted yet (it stays waiting)."""
        ...


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv_cache: KVCacheManager,
        readiness: ReadinessCheck | None = None,
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.readiness = readiness
        self.waiting = make_request_queue(config.scheduling_policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.slots = SlotTable(config.max_num_seqs)
        self.batching = make_batching_policy(config.batching, self.slots)
        self.prefill_cap = PrefillCap.from_config(config)
        self.num_preemptions = 0
        # Request id -> the order it was added in: the victim order (see _pick_victim).
        self._arrival_order: dict[str, int] = {}
        self._num_added = 0
        self._step_id = 0
        self._ended_since_last_step: list[str] = []

    # ------------------------------------------------------------------ requests in/out

    def add_request(self, request: Request) -> None:
        """Queue a request; raises ValueError for one that could never run."""
        self.check_admissible(request)
        # Without max_tokens a request generates until the context is full; a cache smaller
        # than max_model_len makes that the cache's capacity (the last sampled token
        # needs no slot).
        capacity = self.kv_cache.num_blocks * self.kv_cache.block_size + 1
        request.max_model_len = min(request.max_model_len, self.config.max_model_len, capacity)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._arrival_order[request.request_id] = self._num_added
        self._num_added += 1
        self.waiting.add(request)

    def check_admissible(self, request: Request) -> None:
        """Raise ValueError (vLLM's wording where clients match on it) for a request that
        could never run; change nothing."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if not isinstance(request.priority, int) or isinstance(request.priority, bool):
            raise InvalidRequestError(
                f"priority must be an integer, got {request.priority!r}", "priority"
            )
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise InvalidRequestError("The decoder prompt cannot be empty", "prompt")
        max_len = self.config.max_model_len
        if num_prompt >= max_len:  # vLLM's words (the OpenAI API's, which clients look for)
            room = (
                "which exceeds this limit even without any output tokens" if num_prompt > max_len
                else "which leaves no room for an output token"
            )
            raise InvalidRequestError(
                f"This model's maximum context length is {max_len} tokens. However, your "
                f"prompt contains {num_prompt} input tokens, {room}. Please reduce the "
                "length of the input prompt (or raise the engine's max_model_len, where the "
                "model allows it).",
                "prompt",
            )
        limit = request.sampling_params.max_tokens
        # max_tokens=None is capped at the cache's capacity in add_request; only the prompt
        # (plus one token) must fit then. A larger max_tokens is capped at max_model_len.
        longest = min(max_len, num_prompt + (limit if limit else 1))
        # The final sampled token needs no KV slot of its own.
        needed = self.kv_cache.blocks_needed(max(longest - 1, num_prompt))
        if needed > self.kv_cache.num_blocks:
            raise InvalidRequestError(
                f"the request needs up to {needed} KV blocks of {self.kv_cache.block_size} "
                f"tokens but the whole cache has {self.kv_cache.num_blocks}; shorten the prompt "
                "or max_tokens, or give the cache more memory",
                "prompt",
            )

    def abort_request(self, request_id: str) -> Request | None:
        """Stop a request wherever it is and free its blocks; None if unknown or done."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request from outside the step (abort, or a stop string found in its text)."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, status)
        return request

    def reset_counters(self) -> None:
        """Start step ids and the preemption count again from zero (after a warm-up run);
        only while no request is in flight."""
        assert not self.has_unfinished_requests(), "reset_counters() needs an idle scheduler"
        self._step_id = 0
        self.num_preemptions = 0

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        preempted: list[str] = []
        prefills = self.prefill_cap.start_step(len(self.running) + len(self.waiting))

        budget = self._schedule_running(budget, scheduled, preempted, prefills)
        if not preempted:
            self._schedule_waiting(budget, scheduled, prefills)

        output = SchedulerOutput(
            step_id=self._step_id,
            scheduled=list(scheduled.values()),
            preempted_request_ids=preempted,
            finished_request_ids=self._ended_since_last_step,
        )
        self._ended_since_last_step = []
        self._step_id += 1
        return output

    def _schedule_running(
        self, budget: int, scheduled: dict[str, ScheduledRequest], preempted: list[str],
        prefills: StepPrefills,
    ) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = prefills.tokens_for(request.num_tokens - request.num_computed_tokens)
            if num_new == 0:  # a long prompt past the step's long limit: next step
                index += 1
                continue
            num_new = min(num_new, budget)
            while self.kv_cache.allocate_slots(
                request.request_id, request.num_computed_tokens + num_new
            ) is None:
                victim = self._pick_victim()
                victim_index = self.running.index(victim)
                self._preempt(victim)
                preempted.append(victim.request_id)
                unscheduled = scheduled.pop(victim.request_id, None)
                if unscheduled is not None:
                    budget += unscheduled.num_tokens
                if victim is request:
                    break
                if victim_index < index:
                    index -= 1
            else:
                scheduled[request.request_id] = self._plan(request, num_new)
                budget -= num_new
                index += 1
        return budget

    def _schedule_waiting(
        self, budget: int, scheduled: dict[str, ScheduledRequest], prefills: StepPrefills
    ) -> None:
        for request in self.batching.admissible(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if self.readiness is not None and not self.readiness.is_ready(request):
                continue
            # Blocks of a prefix already in the cache are taken, not recomputed.
            prefix = self.kv_cache.find_cached_prefix(request)
            num_new = request.num_tokens - prefix.num_tokens
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            allowed = prefills.tokens_for(num_new)
            if allowed == 0:  # a long prompt past the step's long limit: shorter ones pass
                continue
            num_new = min(allowed, budget)
            num_total = prefix.num_tokens + num_new
            if self.kv_cache.allocate_slots(request.request_id, num_total, prefix) is None:
                break
            self.waiting.remove(request)
            request.num_computed_tokens = prefix.num_tokens
            if request.num_cached_tokens is None:
                request.num_cached_tokens = prefix.num_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self.batching.on_admitted(request)
            scheduled[request.request_id] = self._plan(request, num_new, prefix.num_tokens)
            budget -= num_new

    def _plan(self, request: Request, num_new: int, num_cached: int = 0) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        is_decode = num_new == 1 and start == request.num_tokens - 1 and start >= (
            request.num_prompt_tokens
        )
        params = request.sampling_params
        sample = end == request.num_tokens and not request.is_prefill_only
        targets: tuple[int, ...] = ()
        if params.prompt_logprobs is not None and start < request.num_prompt_tokens - 1:
            targets = tuple(request.prompt_token_ids[start + 1 : end + 1])
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:end],
            start_position=start,
            block_ids=list(self.kv_cache.get_block_ids(request.request_id)),
            sample=sample,
            is_prefill=not is_decode,
            sampling_params=request.sampling_params,
            slot=self.slots.slot_of(request.request_id),
            num_cached_tokens=num_cached,
            suppressed_token_ids=request.suppressed_token_ids if sample else (),
            prompt_token_ids=request.prompt_token_ids if params.repetition_penalty != 1.0 else (),
            prompt_logprob_targets=targets,
        )

    def _pick_victim(self) -> Request:
        """The running request the waiting queue would serve last: under FCFS the latest
        added; under priority the lowest priority (largest value), then the latest arrival.

        Not ``running[-1]`` (the latest *admitted*): a resumed request is appended there,
        so it would be preempted again and again before making progress."""
        order = self._arrival_order
        if self.config.scheduling_policy == "priority":
            return max(
                self.running,
                key=lambda r: (r.priority, r.arrival_time, order[r.request_id]),
            )
        return max(self.running, key=lambda r: order[r.request_id])

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request.request_id)
        self.batching.on_left(request, finished=False)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    # ------------------------------------------------------------------ after the step

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestUpdate]:
        """Apply one step's results: append tokens, stop requests, end failed ones."""
        updates: list[RequestUpdate] = []
        sampled = runner_output.sampled_token_ids
        failed = runner_output.failed_requests
        for item in scheduler_output.scheduled:
            request = self.requests.get(item.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if item.request_id in failed:
                updates.append(self._fail(request, failed[item.request_id]))
                continue
            request.num_computed_tokens += item.num_tokens
            self.kv_cache.cache_full_blocks(request)
            if not item.sample:
                if request.is_prefill_only and request.num_computed_tokens >= request.num_tokens:
                    updates.append(self._end_prefill_only(request))
                continue
            token = sampled[item.request_id]
            request.append_output_token(token)
            status = request.check_stop()
            if (
                status is None
                and item.request_id in runner_output.grammar_finished_request_ids
                and not request.eos_can_end_next
            ):
                # The output is complete and the EOS the grammar now forces would not end it.
                status = RequestStatus.FINISHED_STOPPED
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
            updates.append(
                RequestUpdate(
                    request_id=request.request_id,
                    new_token_ids=[token],
                    finished=request.is_finished,
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                )
            )
        return updates

    def _end_prefill_only(self, request: Request) -> RequestUpdate:
        """A max_tokens=0 request whose prompt is computed: it ends with "length"."""
        self.running.remove(request)
        self._finish(request, RequestStatus.FINISHED_LENGTH)
        return RequestUpdate(
            request_id=request.request_id, new_token_ids=[], finished=True,
            finish_reason=request.status.finish_reason,
        )

    def _fail(self, request: Request, message: str) -> RequestUpdate:
        """End one request whose part of the step failed; its blocks are freed at once."""
        request.error = message
        self.running.remove(request)
        self._finish(request, RequestStatus.FINISHED_ERROR)
        return RequestUpdate(
            request_id=request.request_id,
            new_token_ids=[],
            finished=True,
            finish_reason=request.status.finish_reason,
            error=message,
        )

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv_cache.free(request.request_id)
        self.batching.on_left(request, finished=True)
        self._ended_since_last_step.append(request.request_id)
        del self.requests[request.request_id]
        del self._arrival_order[request.request_id]

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Block accounting and queue consistency; tests call this after every step."""
        self.kv_cache.check_invariants()
        running_ids = {r.request_id for r in self.running}
        waiting_ids = {r.request_id for r in self.waiting}
        assert not running_ids & waiting_ids, "a request is both running and waiting"
        assert running_ids | waiting_ids == set(self.requests), "a request is lost"
        assert len(self.running) <= self.config.max_num_seqs
        for request in self.running:
            assert request.status is RequestStatus.RUNNING
            assert request.num_computed_tokens <= request.num_tokens
        for request in self.waiting:
            assert request.num_computed_tokens == 0
            assert not self.kv_cache.get_block_ids(request.request_id)
