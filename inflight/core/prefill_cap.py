"""How many prompt tokens one request may take in a step: vLLM's
``long_prefill_token_threshold`` (pure Python).

Without a cap, chunked prefill gives a long prompt the whole token budget, so one
1000-token prompt fills a step that other newcomers (and their TTFT) wait behind. With a
threshold ``t > 0`` a request with more than ``t`` prompt tokens left gets ``t`` in this
step and the rest in later ones, leaving the budget to the requests behind it. The cap
is lifted when the request is alone (running and waiting, as vLLM counts): there is nobody
to starve then. ``adaptive`` floors the cap at a fair share of the budget,
``max_num_batched_tokens // requests``, so that few requests never leave most of the
budget unused.
"""

from __future__ import annotations

from dataclasses import dataclass

from inflight.config import SchedulerConfig


@dataclass(frozen=True, slots=True)
class PrefillCap:
    threshold: int  # 0: no cap
    adaptive: bool
    budget: int  # max_num_batched_tokens

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> PrefillCap:
        return cls(
            threshold=config.long_prefill_token_threshold,
            adaptive=config.long_prefill_token_threshold_adaptive,
            budget=config.max_num_batched_tokens,
        )

    def for_step(self, num_requests: int) -> int:
        """The most new tokens one request may take in a step that starts with
        ``num_requests`` requests running or waiting; 0 means no cap."""
        if self.threshold <= 0 or num_requests <= 1:
            return 0
        if self.adaptive:
            return max(self.threshold, self.budget // num_requests)
        return self.threshold


def capped(num_new: int, cap: int) -> int:
    """``num_new`` tokens limited to ``cap`` (0: unlimited)."""
    return min(num_new, cap) if cap > 0 else num_new
