"""The two records that cross between the scheduler and the model runner.

The scheduler says which tokens of which requests to run (``SchedulerOutput``); the runner
answers with the sampled tokens and the requests whose part of the step failed
(``ModelRunnerOutput``). Nothing else crosses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from inflight.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step: tokens at positions ``start_position ..``."""

    request_id: str
    token_ids: list[int]
    start_position: int
    block_ids: list[int]
    # True when this chunk reaches the end of the known tokens, so a new token is sampled.
    sample: bool
    # Prompt tokens (or recomputation after preemption) rather than one decode token.
    is_prefill: bool
    sampling_params: SamplingParams
    # The batch slot the request occupies (for traces and schedule pictures).
    slot: int
    # Tokens taken from the prefix cache when the request was admitted in this step.
    num_cached_tokens: int = 0
    # Token ids the sampled token may not be (stop and EOS ids while min_tokens is unmet).
    suppressed_token_ids: tuple[int, ...] = ()
    # The prompt (a reference, not a copy) for requests whose sampler needs it
    # (repetition_penalty); empty otherwise.
    prompt_token_ids: Sequence[int] = ()
    # With prompt_logprobs: the prompt tokens at positions start+1 .. start+len, whose
    # logprobs this chunk's positions predict (empty past the prompt's last token).
    prompt_logprob_targets: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    step_id: int
    scheduled: list[ScheduledRequest]
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests that ended since the previous step: the runner may drop their state.
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log probabilities at one position, from the raw distribution: the chosen token's
    (``token_id``, ``logprob``, ``rank`` with 1 the most likely) and the top k, best first."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class PromptLogprobsChunk:
    """Prompt logprobs computed in one step: ``entries[j]`` is for the prompt token at
    position ``first_position + j`` (never 0: the first prompt token has none)."""

    first_position: int
    entries: list[TokenLogprobs]


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    # request id -> sampled token, for every scheduled request with ``sample=True`` that
    # did not fail.
    sampled_token_ids: dict[str, int]
    # request id -> why preparing its part of the step failed (its sampler state, its
    # inputs). Only these requests end, with FINISHED_ERROR; the others' tokens are valid.
    failed_requests: dict[str, str] = field(default_factory=dict)
    # Constrained requests whose grammar is complete with this step's token (nothing but
    # EOS may follow): the scheduler lets them sample that EOS where it would end them (as
    # vLLM), else finishes them with "stop" (Request.eos_can_end_next).
    grammar_finished_request_ids: set[str] = field(default_factory=set)
    # request id -> the sampled token's logprobs, for requests that asked (logprobs=k).
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # request id -> prompt logprobs computed this step (prompt_logprobs=k).
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RequestUpdate:
    """What one step did to one request, as reported by the scheduler to the engine."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # the failure's message when finish_reason is "error"
