"""What the engine hands back to callers, named as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # "stop", "length", "abort" or "error"; None while running.
    finish_reason: str | None = None
    # The stop token id or stop string that ended it; None for EOS and the other reasons.
    stop_reason: int | str | None = None
    logprobs: None = None  # seam for a later issue
    # Why the request failed when finish_reason is "error" (only this request ended).
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times (time.monotonic seconds) of a request's life."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = field(default=None, repr=False)
    # Prompt tokens whose KV came from the prefix cache (vLLM's name).
    num_cached_tokens: int = 0
