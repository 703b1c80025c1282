"""Request-output assembly (vLLM V1's ``OutputProcessor``): what the engine keeps per
request beside the scheduler's ``Request``, and the turn of each step's
``RequestUpdate``s into ``RequestOutput``s.

    RequestUpdate -> logprobs, metrics -> detokenise, stop strings -> RequestOutput
                  -> (a child of an n > 1 request) merged into its parent's output

The engine adds and aborts the states (``request_states``, ``parent_requests``,
``child_of``); this module reads and finishes them as outputs come.

Logprobs: the runner reports the raw distribution's logprobs of each sampled token (and
of prompt tokens) as :class:`TokenLogprobs`; the engine turns them into vLLM's
``list[dict[int, Logprob]]`` and sums ``cumulative_logprob``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inflight.core.interface import ModelRunnerOutput, PromptLogprobsChunk, RequestUpdate
from inflight.core.request import Request, RequestStatus
from inflight.core.scheduler import Scheduler
from inflight.engine.detokenizer import IncrementalDetokenizer
from inflight.engine.logprobs_decoder import LogprobsDecoder
from inflight.outputs import (
    CompletionOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from inflight.sampling_params import INT64_MAX, INT64_MIN, SamplingParams

if TYPE_CHECKING:
    from inflight.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass
class RequestState:
    """What the engine keeps per request beside the scheduler's ``Request``."""

    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer | None
    stream: bool
    metrics: RequestMetrics
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class ParentState:
    """An ``n > 1`` request: its children's latest completions, merged into one output."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    child_ids: list[str]
    stream: bool
    completions: list[CompletionOutput]
    finished: list[bool]
    # Children not yet added (waiting for child 0's prompt): (child id, params).
    pending: list[tuple[str, SamplingParams]]
    add_options: dict[str, Any]
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None


class OutputProcessor:
    """Turns a step's ``RequestUpdate``s into ``RequestOutput``s: finished requests',
    and streaming ones' at every step. A stop string found here finishes the request in
    the scheduler; a finished request's grammar matcher and state are freed."""

    def __init__(
        self, tokenizer: Any, scheduler: Scheduler, structured_output: StructuredOutputManager
    ) -> None:
        self.scheduler = scheduler
        self.structured_output = structured_output
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentState] = {}
        self.child_of: dict[str, tuple[str, int]] = {}  # child id -> (parent id, index)
        self._logprobs_decoder = LogprobsDecoder(tokenizer)

    def add_parent(self, parent: ParentState) -> None:
        """Merge the outputs of ``parent``'s children into its own from now on."""
        self.parent_requests[parent.request_id] = parent
        for index, child_id in enumerate(parent.child_ids):
            self.child_of[child_id] = (parent.request_id, index)

    def pop_parent(self, request_id: str) -> ParentState | None:
        """Forget an aborted ``n > 1`` request (None if ``request_id`` is not one); its
        children are the caller's to abort."""
        parent = self.parent_requests.pop(request_id, None)
        if parent is not None:
            parent.pending = []
            for child_id in parent.child_ids:
                self.child_of.pop(child_id, None)
        return parent

    def has_pending_children(self) -> bool:
        """Whether some ``n > 1`` request still has children to add."""
        return any(p.pending for p in self.parent_requests.values())

    def process_outputs(
        self, updates: list[RequestUpdate], now: float, runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """The outputs to give for one step's updates (an n > 1 request's merged)."""
        if runner_output.prompt_logprobs:
            self._take_prompt_logprobs(runner_output.prompt_logprobs)
        outputs = [
            o for u in updates if (o := self._process_update(u, now, runner_output)) is not None
        ]
        if self.child_of:
            outputs = [m for o in outputs if (m := self._merge_child(o)) is not None]
        return outputs

    def _process_update(
        self, update: RequestUpdate, now: float, runner_output: ModelRunnerOutput
    ) -> RequestOutput | None:
        state = self.request_states[update.request_id]
        metrics = state.metrics
        if state.logprobs is not None and update.new_token_ids:
            entry = runner_output.logprobs.get(update.request_id)
            if entry is not None:
                state.logprobs.append(self._logprobs_decoder.position(
                    entry, state.request.sampling_params.detokenize))
                state.cumulative_logprob = (state.cumulative_logprob or 0.0) + entry.logprob
        if update.new_token_ids:
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
        finished = update.finished
        if update.error is not None:
            logger.warning("request %s failed: %s", update.request_id, update.error)
        elif state.detokenizer is not None and (state.stream or state.request.sampling_params.stop):
            stop = state.detokenizer.add_tokens(
                update.new_token_ids, stop_terminated=finished and _stopped_by_token(state.request)
            )
            if stop is not None:
                # A stop string wins even when the same token also hit EOS or the length limit.
                if not finished:
                    self.scheduler.finish_request(update.request_id, RequestStatus.FINISHED_STOPPED)
                state.request.status = RequestStatus.FINISHED_STOPPED
                state.request.stop_reason = stop
                finished = True
        if finished:
            self.structured_output.free([update.request_id])
            metrics.finished_time = now
            metrics.num_preemptions = state.request.num_preemptions
            del self.request_states[update.request_id]
        elif not state.stream:
            return None
        return self._make_output(state, finished)

    def _make_output(self, state: RequestState, finished: bool) -> RequestOutput:
        request = state.request
        text = ""
        if state.detokenizer is not None:
            if not (state.stream or request.sampling_params.stop):
                # decoded once, at the end, off the per-step path
                state.detokenizer.add_tokens(
                    request.output_token_ids, stop_terminated=_stopped_by_token(request)
                )
            text = state.detokenizer.text
        completion = CompletionOutput(
            index=0, text=text, token_ids=list(request.output_token_ids),
            finish_reason=request.status.finish_reason if finished else None,
            stop_reason=request.stop_reason if finished else None,
            error=request.error if finished else None,
            logprobs=None if state.logprobs is None else list(state.logprobs),
            cumulative_logprob=state.cumulative_logprob,
        )
        return RequestOutput(
            request_id=request.request_id, prompt=state.prompt,
            prompt_token_ids=request.prompt_token_ids, outputs=[completion],
            finished=finished, metrics=state.metrics,
            num_cached_tokens=request.num_cached_tokens or 0,
            prompt_logprobs=None if state.prompt_logprobs is None else list(state.prompt_logprobs),
        )

    # ------------------------------------------------------------------ prompt logprobs, n > 1

    def _take_prompt_logprobs(self, chunks: dict[str, PromptLogprobsChunk]) -> None:
        """Store each position once (a preempted request recomputes its prompt)."""
        for request_id, chunk in chunks.items():
            state = self.request_states.get(request_id)
            if state is None or state.prompt_logprobs is None:
                continue
            for offset, entry in enumerate(chunk.entries):
                position = chunk.first_position + offset
                if state.prompt_logprobs[position] is None:
                    state.prompt_logprobs[position] = self._logprobs_decoder.position(
                        entry, state.request.sampling_params.detokenize)

    def _merge_child(self, output: RequestOutput) -> RequestOutput | None:
        """Fold a child's output into its parent's; the parent's output when there is one
        to give (streaming, or every child finished)."""
        link = self.child_of.get(output.request_id)
        if link is None:
            return output  # an n == 1 request
        parent_id, index = link
        parent = self.parent_requests[parent_id]
        completion = output.outputs[0]
        completion.index = index
        parent.completions[index] = completion
        if index == 0:
            parent.num_cached_tokens = output.num_cached_tokens
            parent.prompt_logprobs = output.prompt_logprobs
        if output.finished:
            parent.finished[index] = True
            del self.child_of[output.request_id]
        done = all(parent.finished)
        if done:
            del self.parent_requests[parent_id]
        elif not parent.stream:
            return None
        return RequestOutput(
            request_id=parent_id, prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids, outputs=list(parent.completions),
            finished=done, metrics=parent.metrics, num_cached_tokens=parent.num_cached_tokens,
            prompt_logprobs=parent.prompt_logprobs,
        )


def _stopped_by_token(request: Request) -> bool:
    """Ended by EOS or a stop token id (not a stop string, nor a complete structured
    output, whose last token is part of it): that token's text is left out."""
    if request.status is not RequestStatus.FINISHED_STOPPED or isinstance(
        request.stop_reason, str
    ) or not request.output_token_ids:
        return False
    last = request.output_token_ids[-1]
    return last in request.eos_token_ids or last in request.stop_token_ids


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Completion ``index`` of an n > 1 request: n=1, its own seed (``seed + index``,
    wrapped into int64); only child 0 asks for prompt logprobs (unless max_tokens=0)."""
    seed = params.seed
    if seed is not None:
        seed = (seed + index - INT64_MIN) % (INT64_MAX - INT64_MIN + 1) + INT64_MIN
    keep_prompt_logprobs = index == 0 or params.max_tokens == 0
    return dataclasses.replace(
        params, n=1, best_of=None, seed=seed,
        prompt_logprobs=params.prompt_logprobs if keep_prompt_logprobs else None,
    )
