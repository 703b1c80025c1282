"""What the engine hands back to callers, named as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One token's log probability at one position (vLLM's ``Logprob``): from the model's
    raw distribution; ``rank`` 1 is the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob, the chosen (or prompt) token first, then the top k.
PositionLogprobs = dict[int, Logprob]
SampleLogprobs = list[PositionLogprobs]
# Per prompt token; the first entry is None (nothing predicts the first token).
PromptLogprobs = list[PositionLogprobs | None]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # "stop", "length", "abort" or "error"; None while running.
    finish_reason: str | None = None
    # The stop token id or stop string that ended it; None for EOS and the other reasons.
    stop_reason: int | str | None = None
    # With SamplingParams.logprobs: one dict per generated token; else None.
    logprobs: SampleLogprobs | None = None
    # Sum of the generated tokens' logprobs (raw distribution), with logprobs; else None.
    cumulative_logprob: float | None = None
    # Why the request failed when finish_reason is "error" (only this request ended).
    error: str | None = None

    def finished(self) -> bool:
        """Whether this completion has ended (a method, as vLLM's)."""
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
    # With SamplingParams.prompt_logprobs: one entry per prompt token, the first None.
    prompt_logprobs: PromptLogprobs | None = None
