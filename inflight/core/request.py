"""The scheduler's view of one request: its tokens, progress and state.

Invariant: ``num_computed_tokens <= num_tokens``; tokens ``[0, num_computed_tokens)`` have
their K/V in the cache. After a preemption ``num_computed_tokens`` falls back to 0 and the
whole sequence (prompt plus tokens generated so far) is recomputed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from inflight.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
}
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = 0.0
    priority: int = 0
    # Upper bound on prompt + output tokens (the model's context length).
    max_model_len: int = 1 << 30
    # Mixed into the prefix-cache hash of the first block: requests with different salts
    # never share cached blocks (vLLM's ``cache_salt``).
    cache_salt: str | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    # The token that stopped the request (EOS or a stop token), when that is the reason.
    stop_reason: int | str | None = None
    # Prompt tokens found in the prefix cache at first admission (None until admitted).
    num_cached_tokens: int | None = None
    # Chained hashes of the full blocks of ``all_token_ids``, filled by the KV cache
    # manager as blocks fill up (kept across preemption, so re-admission is cheap).
    block_hashes: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_output_tokens(self) -> int:
        """Output tokens allowed by ``max_tokens`` and by the context length."""
        room = max(1, self.max_model_len - self.num_prompt_tokens)
        limit = self.sampling_params.max_tokens
        return room if limit is None else min(limit, room)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self) -> RequestStatus | None:
        """The finished status implied by the last output token, or None to go on."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:  # type: ignore[operator]
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_output_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
