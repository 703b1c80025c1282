"""Per-request sampling options, named as in vLLM, validated on construction.

Pure Python (no torch): the scheduler reads the stop-related fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

_GREEDY_EPS = 1e-5


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request's continuation.

    ``temperature=0`` means greedy. ``max_tokens=None`` means "until the model's context
    length". Fields not yet implemented by the engine (``n > 1``, ``logprobs``, penalties)
    are accepted only at their neutral values, so callers get a clear error rather than a
    silently ignored option.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True

    # Filled by the engine, not the user: the model's end-of-sequence ids.
    _eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None:
            self.top_k = 0
        self._validate()

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> SamplingParams:
        """Build from a plain dict, rejecting unknown field names by name."""
        known = {f.name for f in fields(cls) if not f.name.startswith("_")}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"unknown sampling field(s) {unknown}; known fields: {sorted(known)}"
            )
        return cls(**options)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def _validate(self) -> None:
        def fail(message: str) -> None:
            raise ValueError(f"SamplingParams: {message}")

        if not isinstance(self.n, int) or self.n < 1:
            fail(f"n must be a positive integer, got {self.n!r}")
        if self.n != 1:
            fail("n > 1 is not supported yet")
        _check_number("temperature", self.temperature, low=0.0)
        _check_number("top_p", self.top_p, low=0.0, high=1.0)
        if self.top_p <= 0.0:
            fail(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            fail(f"top_k must be an integer, got {self.top_k!r}")
        if self.top_k < -1:
            fail(f"top_k must be -1 or 0 (disabled) or a positive integer, got {self.top_k}")
        _check_number("min_p", self.min_p, low=0.0, high=1.0)
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            fail(f"seed must be an integer, got {self.seed!r}")
        if self.max_tokens is not None:
            if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
                fail(f"max_tokens must be an integer, got {self.max_tokens!r}")
            if self.max_tokens < 1:
                fail(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for s in self.stop:  # type: ignore[union-attr]
            if not isinstance(s, str) or not s:
                fail(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:  # type: ignore[union-attr]
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                fail(f"stop_token_ids must be non-negative integers, got {t!r}")
        if self.logprobs is not None:
            fail("logprobs is not supported yet")
        for name, neutral in (
            ("presence_penalty", 0.0),
            ("frequency_penalty", 0.0),
            ("repetition_penalty", 1.0),
        ):
            value = getattr(self, name)
            _check_number(name, value)
            if value != neutral:
                fail(f"{name} is not supported yet (got {value})")


def _check_number(
    name: str, value: Any, low: float | None = None, high: float | None = None
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"SamplingParams: {name} must be a number, got {value!r}")
    if value != value:  # NaN
        raise ValueError(f"SamplingParams: {name} must not be NaN")
    if low is not None and value < low:
        raise ValueError(f"SamplingParams: {name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"SamplingParams: {name} must be <= {high}, got {value}")
