"""Per-request sampling options, named as in vLLM, validated on construction.

Pure Python (no torch): the scheduler reads the stop-related fields.
"""

from __future__ import annotations

import copy
import enum
import json as _json
import math
from dataclasses import dataclass, field, fields
from typing import Any, NoReturn

_GREEDY_EPS = 1e-5
# Integers that reach torch (seed, token ids, counts) must fit a signed 64-bit integer;
# vLLM's OpenAI protocol bounds ``seed`` to this same range (torch.long).
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


class InvalidRequestError(ValueError):
    """A request carries a value the engine cannot use; ``parameter`` names the field.

    Raised when the request is created (never during a step), so nothing else is touched;
    the server answers it with a 400 that names ``parameter``.
    """

    def __init__(self, message: str, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter


# How a request whose parameters leave no token samplable fails (the sampler's message
# starts with it; the server answers it with a 400, the client's parameters being the cause).
NO_TOKEN_LEFT = "no token can be sampled"
# How a request whose structured-output constraint fails to compile or to run fails (the
# manager's messages start with it; the server answers a 400 naming structured_outputs).
CONSTRAINT_FAILED = "structured outputs:"


class RequestOutputKind(enum.Enum):
    """vLLM's ``output_kind``: what each output of a running request carries."""

    CUMULATIVE = 0  # everything so far (vLLM's default)
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # one output, when the request finishes (what LLM.generate returns)


class SamplingType(enum.IntEnum):
    """vLLM's ``SamplingParams.sampling_type``."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request's continuation.

    ``temperature=0`` means greedy. ``max_tokens=None`` means "until the model's context
    length"; ``max_tokens=0`` is allowed only with ``prompt_logprobs`` (the request then
    only prefills its prompt and returns the prompt's logprobs, finish_reason "length").

    Sampling transforms, applied to the logits in vLLM's order: ``allowed_token_ids`` (every
    other token is masked), ``bad_words`` (strings, tokenised by the engine: a one-token
    word is always banned, a longer one when its other tokens were just generated),
    ``logit_bias`` (token id -> added bias, [-100, 100]), then the penalties:
    ``repetition_penalty`` over prompt and generated tokens (HF / vLLM: a seen token's
    positive logit is divided by it, a negative one multiplied), ``frequency_penalty``
    (minus penalty x count) and ``presence_penalty`` (minus penalty once) over generated
    tokens (OpenAI's definition). Random sampling then applies ``temperature``, ``min_p``,
    ``top_k`` and ``top_p``, also in vLLM's order: ``top_p`` measures the mass of what
    ``min_p`` and ``top_k`` left.

    ``n`` completions share the prompt (``seed + index`` seeds completion ``index``);
    ``best_of`` other than None or ``n`` is refused. ``logprobs=k`` returns, per generated
    token, its logprob and the top k; ``prompt_logprobs=k`` the same for every prompt token
    (the first entry None). Logprobs are from the model's raw distribution, before
    temperature, penalties, biases and truncation (vLLM's default ``raw_logprobs``).

    Every value is checked here, on construction, against the range the engine can use
    (``seed`` within torch.long, counts within int64, booleans really bool), raising
    :class:`InvalidRequestError` naming the field. Token ids are checked against the
    vocabulary when the request is added (``LLMEngine.add_request``).

    Stop semantics follow vLLM: ``min_tokens`` holds back EOS, ``stop_token_ids`` (both
    masked from sampling) and stop strings (not searched) until that many tokens exist;
    the text of a stop token or EOS that ends the request is left out of ``text`` unless
    ``include_stop_str_in_output`` (its id stays in ``token_ids``).

    vLLM's conveniences: ``seed=-1`` means no seed (random); ``logprobs=True`` means 1 and
    ``logprobs=-1`` the whole vocabulary (likewise ``prompt_logprobs``; both still within
    the engine's ``max_logprobs``, which -1 lifts); ``truncate_prompt_tokens=k`` keeps the
    prompt's last k tokens (-1: the last ``max_model_len``); ``guided_decoding`` is the old
    name of ``structured_outputs``. ``output_kind`` is CUMULATIVE or FINAL_ONLY (DELTA is
    refused by ``LLMEngine.add_request``); ``extra_args`` is kept for the caller's own use;
    ``spaces_between_special_tokens`` is accepted for vLLM's scripts and changes nothing
    (fast tokenizers, the only kind inflight runs, decode the same either way, as in
    vLLM); per-request ``logits_processors`` are refused, as in vLLM V1.
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
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    best_of: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: dict[str, Any] | None = None
    logits_processors: Any = None

    # --- structured outputs (constrained decoding); see StructuredOutputsParams below.
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's old name; moved over
    # --- end structured outputs

    # Filled by the engine, not the user: the model's end-of-sequence ids.
    _eos_token_ids: tuple[int, ...] = field(default=(), repr=False)
    # Filled by the engine: each bad word's token ids (with and without a leading space).
    _bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if _is_int(self.seed) and self.seed == -1:
            self.seed = None  # vLLM's "no seed"
        for name in ("logprobs", "prompt_logprobs"):
            if isinstance(getattr(self, name), bool):  # as vLLM: True is 1, False 0
                setattr(self, name, int(getattr(self, name)))
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                _fail("guided_decoding", "pass structured_outputs or guided_decoding, not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list("stop", self.stop) or []
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids) or []
        if self.top_k is None:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):  # e.g. from_dict / JSON bodies
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if self.logit_bias is not None:
            self.logit_bias = _int_keys(self.logit_bias)
        self.allowed_token_ids = _as_list("allowed_token_ids", self.allowed_token_ids)
        self.bad_words = _as_list("bad_words", self.bad_words)
        self._validate()

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> SamplingParams:
        """Build from a plain dict, rejecting unknown field names by name."""
        known = {f.name for f in fields(cls) if not f.name.startswith("_")}
        unknown = sorted(set(options) - known, key=repr)  # keys of any type, sortable
        if unknown:
            raise ValueError(
                f"unknown sampling field(s) {unknown}; known fields: {sorted(known)}"
            )
        return cls(**options)

    @classmethod
    def from_optional(cls, **options: Any) -> SamplingParams:
        """vLLM's constructor for optional values: a None means the field's default
        (``max_tokens=None`` keeps its meaning, no limit). As in vLLM, ``logit_bias``
        values are clamped to [-100, 100] here (the constructor refuses them outside)."""
        bias = options.get("logit_bias")
        if isinstance(bias, dict):
            options["logit_bias"] = {token: _clamped_bias(b) for token, b in bias.items()}
        return cls(**{k: v for k, v in options.items() if v is not None or k == "max_tokens"})

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's ``clone``)."""
        return copy.deepcopy(self)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def all_stop_token_ids(self) -> set[int]:
        """``stop_token_ids`` and the model's end-of-sequence ids (once the engine has
        filled those in)."""
        return set(self.stop_token_ids or ()) | set(self._eos_token_ids)

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def needs_logits_processing(self) -> bool:
        """True when any transform beyond temperature/top-k/top-p/min-p applies."""
        return (
            self.has_penalties
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or bool(self._bad_words_token_ids)
        )

    def _validate(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            _fail("n", f"n must be a positive integer, got {self.n!r}")
        if self.best_of is not None and self.best_of != self.n:
            _fail("best_of", f"best_of is not supported (got {self.best_of!r}); use n")
        _check_number("temperature", self.temperature, low=0.0)
        _check_number("top_p", self.top_p, low=0.0, high=1.0)
        if self.top_p <= 0.0:
            _fail("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k):
            _fail("top_k", f"top_k must be an integer, got {self.top_k!r}")
        # Values above the vocabulary size mean "all tokens" (the sampler clamps them).
        if not -1 <= self.top_k <= INT64_MAX:
            _fail("top_k", f"top_k must be -1 or 0 (disabled) or a positive integer, got {self.top_k}")
        _check_number("min_p", self.min_p, low=0.0, high=1.0)
        if self.seed is not None:
            if not _is_int(self.seed):
                _fail("seed", f"seed must be an integer, got {self.seed!r}")
            if not INT64_MIN <= self.seed <= INT64_MAX:
                _fail("seed", f"seed must be in [{INT64_MIN}, {INT64_MAX}], got {self.seed}")
        if self.max_tokens is not None:
            _check_count("max_tokens", self.max_tokens, low=0)
            if self.max_tokens == 0 and self.prompt_logprobs is None:
                _fail("max_tokens", "max_tokens must be at least 1 (0 only with prompt_logprobs)")
        _check_count("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for s in self.stop:  # type: ignore[union-attr]
            if not isinstance(s, str) or not s:
                _fail("stop", f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:  # type: ignore[union-attr]
            if not _is_int(t) or not 0 <= t <= INT64_MAX:
                _fail("stop_token_ids", f"stop_token_ids must be non-negative integers, got {t!r}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
                     "detokenize", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.stop and not self.detokenize:
            _fail("stop", "stop strings are only supported when detokenize is True")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_count(name, getattr(self, name), low=-1)  # -1: the whole vocabulary
        self._validate_vllm_extras()
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name), low=-2.0, high=2.0)
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            _fail("repetition_penalty",
                  f"repetition_penalty must be greater than zero, got {self.repetition_penalty}")
        self._validate_token_transforms()
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            _fail(
                "structured_outputs",
                "structured_outputs must be a StructuredOutputsParams, got "
                f"{type(self.structured_outputs).__name__}",
            )

    def _validate_vllm_extras(self) -> None:
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or not (k == -1 or 1 <= k <= INT64_MAX)):
            _fail("truncate_prompt_tokens",
                  f"truncate_prompt_tokens must be -1 or a positive integer, got {k!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            _fail("output_kind", f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            _fail("extra_args", f"extra_args must be a dict, got {type(self.extra_args).__name__}")
        if self.logits_processors:
            _fail("logits_processors",
                  "per-request logits_processors are not supported (as in vLLM V1); use "
                  "logit_bias, allowed_token_ids, bad_words or structured_outputs")

    def _validate_token_transforms(self) -> None:
        """logit_bias, allowed_token_ids, bad_words (token ids are checked against the
        vocabulary by the engine)."""
        for token, bias in (self.logit_bias or {}).items():
            if not 0 <= token <= INT64_MAX:
                _fail("logit_bias", f"logit_bias keys must be token ids, got {token!r}")
            _check_number("logit_bias", bias, low=-100.0, high=100.0)
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                _fail("allowed_token_ids", "allowed_token_ids must not be empty")
            for t in self.allowed_token_ids:
                if not _is_int(t) or not 0 <= t <= INT64_MAX:
                    _fail("allowed_token_ids",
                          f"allowed_token_ids must be non-negative integers, got {t!r}")
        for word in self.bad_words or []:
            if not isinstance(word, str) or not word.strip():
                _fail("bad_words", f"bad_words must be non-empty strings, got {word!r}")


def _as_list(name: str, value: Any) -> list[Any] | None:
    """A list-valued field as a new list (None stays None); a lone string, a mapping or
    a non-iterable is refused by name rather than split or failing later."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        _fail(name, f"{name} must be a list, got {type(value).__name__} {value!r:.60}")
    return list(value)


def _clamped_bias(bias: Any) -> Any:
    """A number clamped to OpenAI's [-100, 100]; anything else (NaN, a string) as it is,
    for the constructor to refuse."""
    if isinstance(bias, (int, float)) and not isinstance(bias, bool) and bias == bias:
        return min(100.0, max(-100.0, float(bias)))
    return bias


def _int_keys(logit_bias: Any) -> dict[int, float]:
    """Token-id keys as ints (JSON sends them as strings), as vLLM's logit_bias."""
    if not isinstance(logit_bias, dict):
        _fail("logit_bias", f"logit_bias must be a mapping of token id to bias, got {logit_bias!r}")
    out: dict[int, float] = {}
    for key, value in logit_bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError, OverflowError):  # int(inf) overflows
            _fail("logit_bias", f"logit_bias keys must be token ids, got {key!r}")
        if isinstance(key, bool) or (isinstance(key, float) and key != token):
            _fail("logit_bias", f"logit_bias keys must be token ids, got {key!r}")
        out[token] = value
    return out


# ---------------------------------------------------------------- structured outputs

_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(slots=True)
class StructuredOutputsParams:
    """What a request's output must match (vLLM's names); exactly one constraint is set.

    * ``json``: a JSON schema (a dict, or its JSON text);
    * ``regex``: a regular expression the whole output must match;
    * ``choice``: the output is exactly one of these strings;
    * ``grammar``: a context-free grammar, in Lark or GBNF (llama.cpp) syntax;
    * ``json_object=True``: any JSON object.

    ``disable_any_whitespace`` forbids whitespace between JSON tokens (by default any
    JSON whitespace is allowed, as in vLLM); ``whitespace_pattern`` is a regex for the
    whitespace allowed there instead. An object schema that lists ``properties`` allows no
    others unless it says so (``additionalProperties``), as vLLM's default xgrammar
    backend in its strict mode and OpenAI's ``strict``; ``disable_additional_properties``
    closes a bare ``{"type": "object"}`` too. ``structural_tag`` is refused by name. The
    shapes are checked here; whether a schema, regex or grammar compiles is checked when
    the request is added to the engine. Both raise :class:`InvalidRequestError` with
    ``parameter="structured_outputs"``.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, str):
            try:
                self.json = _json.loads(self.json)
            except (ValueError, RecursionError) as error:  # too deep: RecursionError
                _fail_structured(f"json is not valid JSON: {error}")
        self._validate()

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> StructuredOutputsParams:
        """Build from a plain dict (a request body), rejecting unknown field names."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known, key=repr)
        if unknown:
            _fail_structured(f"unknown field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**options)

    @property
    def kind(self) -> str:
        """Which constraint is set: one of json, regex, choice, grammar, json_object."""
        return next(name for name in _CONSTRAINTS if self._is_set(name))

    @property
    def key(self) -> tuple[str, str, bool, bool, str | None]:
        """Equal for equal constraints: the grammar cache's key."""
        spec = getattr(self, self.kind)
        text = spec if isinstance(spec, str) else _json.dumps(spec, sort_keys=True)
        return (self.kind, text, self.disable_any_whitespace,
                self.disable_additional_properties, self.whitespace_pattern)

    def _is_set(self, name: str) -> bool:
        value = getattr(self, name)
        return bool(value) if name == "json_object" else value is not None

    def _validate(self) -> None:
        chosen = [name for name in _CONSTRAINTS if self._is_set(name)]
        if len(chosen) != 1:
            _fail_structured(
                f"exactly one of {', '.join(_CONSTRAINTS)} must be set, got "
                f"{', '.join(chosen) if chosen else 'none'}"
            )
        if self.json is not None and not isinstance(self.json, dict):
            _fail_structured(f"json must be a JSON schema object, got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                _fail_structured(f"{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if (
                not isinstance(self.choice, list) or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                _fail_structured(f"choice must be a non-empty list of non-empty strings, got {self.choice!r}")
        for name in ("json_object", "disable_any_whitespace", "disable_additional_properties"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                _fail_structured(f"{name} must be true or false, got {value!r}")
        if self.whitespace_pattern is not None and (
            not isinstance(self.whitespace_pattern, str) or not self.whitespace_pattern
        ):
            _fail_structured(f"whitespace_pattern must be a non-empty regex, got {self.whitespace_pattern!r}")
        if self.structural_tag is not None:
            _fail_structured("structural_tag is not supported; use json, regex, choice or grammar")


def _fail_structured(message: str) -> NoReturn:
    raise InvalidRequestError(f"StructuredOutputsParams: {message}", parameter="structured_outputs")


GuidedDecodingParams = StructuredOutputsParams  # vLLM's name before 0.11

# ---------------------------------------------------------------- end structured outputs


def _fail(name: str, message: str) -> NoReturn:
    # "SamplingParams: <field> ...": the server reads the field name from the message too.
    raise InvalidRequestError(f"SamplingParams: {message}", parameter=name)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_count(name: str, value: Any, low: int) -> None:
    if not _is_int(value):
        _fail(name, f"{name} must be an integer, got {value!r}")
    if not low <= value <= INT64_MAX:
        _fail(name, f"{name} must be in [{low}, {INT64_MAX}], got {value}")


def _check_number(
    name: str, value: Any, low: float | None = None, high: float | None = None
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(name, f"{name} must be a number, got {value!r}")
    if value != value:  # NaN
        _fail(name, f"{name} must not be NaN")
    # Huge ints overflow float arithmetic in the sampler; infinities make NaN there.
    if isinstance(value, float) and not math.isfinite(value):
        _fail(name, f"{name} must be a finite number, got {value}")
    if abs(value) > 1e30:
        _fail(name, f"{name} must be at most 1e30 in magnitude, got {value}")
    if low is not None and value < low:
        _fail(name, f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        _fail(name, f"{name} must be <= {high}, got {value}")


def __getattr__(name: str) -> Any:
    # vLLM's import path for BeamSearchParams (defined with the search, in beam_search.py,
    # which imports this module: so re-exported lazily).
    if name == "BeamSearchParams":
        from inflight.beam_search import BeamSearchParams

        return BeamSearchParams
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
