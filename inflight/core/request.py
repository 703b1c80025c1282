"""The scheduler's view of one request: its tokens, progress and state.

Invariant: ``num_computed_tokens <= num_tokens``; tokens ``[0, num_computed_tokens)`` have
their K/V in the cache. After a preemption ``num_computed_tokens`` falls back to 0 and the
whole sequence (prompt plus tokens generated so far) is recomputed.

Stop rules (vLLM's ``check_stop``), applied after each sampled token:

============================  ==============  ===============================
what the last token is        finish_reason   stop_reason
============================  ==============  ===============================
the primary EOS (not ignored)  "stop"         None
a ``stop_token_ids`` hit       "stop"         the token id
another model EOS id           "stop"         the token id (vLLM merges the
                                              generation config's extra EOS
                                              ids into stop_token_ids)
the ``max_tokens``-th token    "length"       None
the context's last position    "length"       None
============================  ==============  ===============================

None of the token stops count before ``min_tokens`` tokens exist (the sampler also masks
them until then); the length limits always do. Stop strings, aborts ("abort") and
per-request failures ("error") are decided outside this check.
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
    # Something failed while preparing this request's part of a step; it alone ends.
    FINISHED_ERROR = "finished_error"

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
    RequestStatus.FINISHED_ERROR,
}
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # The model's end-of-sequence ids; the first is the primary EOS (the tokenizer's).
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
    # The stop token id or stop string that ended the request (None for EOS, length).
    stop_reason: int | str | None = None
    # Prompt tokens found in the prefix cache at first admission (None until admitted).
    num_cached_tokens: int | None = None
    # Chained hashes of the full blocks of ``all_token_ids``, filled by the KV cache
    # manager as blocks fill up (kept across preemption, so re-admission is cheap).
    block_hashes: list[bytes] = field(default_factory=list)
    # Why the request failed, when its status is FINISHED_ERROR.
    error: str | None = None

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        params = self.sampling_params
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        # Token ids that stop the request with themselves as stop_reason.
        extra_eos = () if params.ignore_eos else self.eos_token_ids[1:]
        self.stop_token_ids = frozenset((*params.stop_token_ids, *extra_eos))  # type: ignore[misc]
        # What min_tokens keeps the sampler from choosing: every stop id and every EOS id,
        # ignore_eos or not (as vLLM's all_stop_token_ids).
        self.all_stop_token_ids = tuple(
            sorted({*params.stop_token_ids, *self.eos_token_ids})  # type: ignore[misc]
        )

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

    @property
    def skip_prefix_cache(self) -> bool:
        """Prompt logprobs need logits at every prompt position, so such a request never
        reads the prefix cache (as vLLM); its computed blocks are still registered."""
        return self.sampling_params.prompt_logprobs is not None

    @property
    def is_prefill_only(self) -> bool:
        """max_tokens=0: the request ends ("length") once its prompt is computed."""
        return self.max_output_tokens == 0

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def suppressed_token_ids(self) -> tuple[int, ...]:
        """Ids the next sampled token may not be: the stop ids while min_tokens is unmet."""
        if self.num_output_tokens < self.sampling_params.min_tokens:
            return self.all_stop_token_ids
        return ()

    @property
    def eos_can_end_next(self) -> bool:
        """Whether an EOS sampled next would end the request: EOS not ignored, min_tokens
        met, and some EOS id not excluded by ``allowed_token_ids``. A finished grammar
        allows only EOS, so such a request samples it (as vLLM does: its EOS is the last
        output token); any other ends at the grammar's end (scheduler.update_from_output)."""
        params = self.sampling_params
        if not self.eos_token_ids or params.ignore_eos:
            return False
        if self.num_output_tokens < params.min_tokens:
            return False
        allowed = params.allowed_token_ids
        return allowed is None or any(eos in allowed for eos in self.eos_token_ids)

    def check_stop(self) -> RequestStatus | None:
        """The finished status implied by the last output token, or None to go on.

        Sets ``stop_reason`` as vLLM does (see the module docstring's table).
        """
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last == self.eos_token_id:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in self.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_output_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
