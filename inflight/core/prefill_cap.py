"""How many prompt tokens one request may take in a step (pure Python): vLLM's
``long_prefill_token_threshold`` and ``max_long_partial_prefills``.

Without a policy, chunked prefill gives prompts the token budget in queue order, so two
long prompts that arrive together share one long step and both get their first token at
its end. Two policies, both off by default:

* **cap** (``long_prefill_token_threshold = t > 0``, vLLM V1's meaning): a request with
  more than ``t`` tokens left gets ``t`` in this step and the rest in later ones. The cap
  is lifted when the request is alone (running and waiting, as vLLM counts): there is
  nobody to starve then. ``adaptive`` floors it at a fair share of the budget,
  ``max_num_batched_tokens // requests``.
* **long limit** (``max_long_partial_prefills = n > 0``, vLLM V0's meaning, with ``t``
  saying what is long): at most ``n`` requests with more than ``t`` tokens left take
  tokens in one step, in queue order, uncapped; the other long ones wait for a later
  step and shorter prompts and decodes pass them. Long prompts then go one after another
  rather than side by side: the first's TTFT is its own prefill, not both, and the
  second's is about what it was (prefill is compute-bound, so sharing a step saves no
  time). The first long request in the queue always runs, so nothing starves.
"""

from __future__ import annotations

from dataclasses import dataclass

from inflight.config import SchedulerConfig


@dataclass(frozen=True, slots=True)
class PrefillCap:
    threshold: int  # 0: neither policy
    adaptive: bool
    budget: int  # max_num_batched_tokens
    max_long: int = 0  # 0: no long limit (then the threshold caps)

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> PrefillCap:
        return cls(
            threshold=config.long_prefill_token_threshold,
            adaptive=config.long_prefill_token_threshold_adaptive,
            budget=config.max_num_batched_tokens,
            max_long=config.max_long_partial_prefills,
        )

    def for_step(self, num_requests: int) -> int:
        """The cap on one request's new tokens in a step that starts with
        ``num_requests`` requests running or waiting; 0 means no cap."""
        if self.threshold <= 0 or self.max_long > 0 or num_requests <= 1:
            return 0
        if self.adaptive:
            return max(self.threshold, self.budget // num_requests)
        return self.threshold

    def start_step(self, num_requests: int) -> StepPrefills:
        return StepPrefills(
            cap=self.for_step(num_requests),
            threshold=self.threshold,
            long_left=self.max_long if self.max_long > 0 else None,  # config: threshold > 0
        )


@dataclass(slots=True)
class StepPrefills:
    """One step's state of the policy: the cap and the long requests still allowed."""

    cap: int  # 0: no cap
    threshold: int
    long_left: int | None  # None: no long limit

    def tokens_for(self, remaining: int) -> int:
        """New tokens a request with ``remaining`` tokens to compute may take (before the
        step's budget); 0: it waits this step. Counts it against the long limit."""
        if self.long_left is not None and remaining > self.threshold:
            if self.long_left == 0:
                return 0
            self.long_left -= 1
            return remaining
        return capped(remaining, self.cap)


def capped(num_new: int, cap: int) -> int:
    """``num_new`` tokens limited to ``cap`` (0: unlimited)."""
    return min(num_new, cap) if cap > 0 else num_new
