"""From a validated API request to the engine's inputs: rules pydantic cannot express.

- Fields the server does not implement are refused by name when set to a non-neutral value
  (the tables in ``request_fields.py``); ``stream_options`` needs ``stream``.
- Prompts: ``truncate_prompt_tokens`` applied, token ids checked against the vocabulary,
  empty prompts refused, and ``prompt + max_tokens`` must fit in ``max_model_len``; the
  messages use vLLM's wording, which clients match on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from inflight.entrypoints.openai.errors import bad_request, from_engine_error
from inflight.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from inflight.entrypoints.openai.request_fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    Treatment,
    log_unknown_fields,
    refuse_legacy_guided_fields,
    refuse_unsupported,
)
from inflight.sampling_params import SamplingParams, StructuredOutputsParams

GenerationRequest = CompletionRequest | ChatCompletionRequest


def check_supported(request: GenerationRequest) -> None:
    """Refuse, by name, fields set to values the server does not implement."""
    table: Mapping[str, Treatment]
    if isinstance(request, CompletionRequest):
        table, endpoint = COMPLETION_FIELDS, "/v1/completions"
    else:
        table, endpoint = CHAT_FIELDS, "/v1/chat/completions"
    log_unknown_fields(request, endpoint)
    if request.stream_options is not None and not request.stream:
        raise bad_request(
            "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    refuse_legacy_guided_fields(request)
    refuse_unsupported(request, table)
    if not request.use_beam_search and request.length_penalty != 1.0:
        raise bad_request("length_penalty only applies with use_beam_search", "length_penalty")


def max_tokens_of(request: GenerationRequest) -> int | None:
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        return request.max_completion_tokens
    return request.max_tokens


def truncate_prompt(
    token_ids: list[int], request: GenerationRequest, max_model_len: int
) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: keep k tokens (-1: max_model_len), by default
    the last k (``truncation_side="left"`` cuts the start)."""
    k = request.truncate_prompt_tokens
    if k is None:
        return token_ids
    if k > max_model_len:
        raise bad_request(
            f"truncate_prompt_tokens value ({k}) is greater than max_model_len "
            f"({max_model_len}). Please request a smaller truncation size.",
            "truncate_prompt_tokens",
        )
    k = max_model_len if k == -1 else k
    if k == 0:
        return []
    if request.truncation_side == "right":
        return token_ids[:k]
    return token_ids[-k:]


def check_prompt_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    """An empty prompt or a token id outside the vocabulary is a 400 (vLLM's words)."""
    if not token_ids:
        raise bad_request("The decoder prompt cannot be empty", param)
    bad = next((i for i in token_ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise bad_request(
            f"Token id {bad} is out of vocabulary (the vocabulary size is {vocab_size})",
            param,
            "invalid_value",
        )


def check_length(
    num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, param: str
) -> int | None:
    """``max_tokens`` cut to the room the prompt leaves in the context, as vLLM 0.32 cuts
    it (``get_max_tokens``; older vLLM and OpenAI refuse a request asking for more). A
    prompt that leaves no room for one token is refused, even with ``max_tokens: 0``."""
    if num_prompt_tokens >= max_model_len:
        why = (
            "leaves no room for an output token" if num_prompt_tokens == max_model_len
            else "exceeds this limit even without any output tokens"
        )
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {num_prompt_tokens} input tokens, which {why}. Please reduce "
            "the length of the input prompt.",
            param,
            "context_length_exceeded",
        )
    return None if max_tokens is None else min(max_tokens, max_model_len - num_prompt_tokens)


def sampling_params(
    request: GenerationRequest,
    max_tokens: int | None,
    structured_outputs: StructuredOutputsParams | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> SamplingParams:
    """The model's defaults (``defaults``, from its generation config), else OpenAI's,
    where the request is silent; engine errors become 400s. A generation config's
    ``max_new_tokens`` caps ``max_tokens`` even when the request sets it (as vLLM).

    Only implemented fields reach the engine: refused ones were checked neutral before.
    Logprobs: completions' ``logprobs`` is the engine's; chat's ``top_logprobs`` is, when
    ``logprobs`` is true. Completions with ``echo`` and ``logprobs`` (or ``max_tokens: 0``
    with ``echo``) also ask for the prompt's logprobs, which the echoed tokens report; so
    does chat's ``echo`` (vLLM's ``prompt_logprobs``, ``top_logprobs`` of them).
    ``structured_outputs`` is the request's constraint (``structured.py``, or a tool
    call's grammar), already validated.
    """
    logprobs, logprobs_param = _logprobs_of(request)
    _check_best_of(request)
    prompt_logprobs = _prompt_logprobs_of(request, max_tokens)
    if max_tokens == 0 and prompt_logprobs is None:
        raise bad_request(
            "max_tokens must be at least 1, or 0 with echo or prompt_logprobs (the prompt's "
            "logprobs alone).",
            "max_tokens",
            "invalid_value",
        )
    defaults = defaults or {}
    return checked_sampling_params(
        {"logprobs": logprobs_param},
        n=1 if request.n is None else request.n,
        temperature=given(request.temperature, defaults, "temperature", 1.0),
        top_p=given(request.top_p, defaults, "top_p", 1.0),
        top_k=given(request.top_k, defaults, "top_k", 0),
        min_p=given(request.min_p, defaults, "min_p", 0.0),
        seed=request.seed,
        max_tokens=capped_max_tokens(max_tokens, defaults),
        min_tokens=request.min_tokens,
        stop=request.stop,
        stop_token_ids=request.stop_token_ids,
        ignore_eos=request.ignore_eos,
        skip_special_tokens=request.skip_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=given(request.repetition_penalty, defaults, "repetition_penalty", 1.0),
        logit_bias=dict(request.logit_bias) if request.logit_bias else None,  # type: ignore[arg-type]
        allowed_token_ids=request.allowed_token_ids,
        bad_words=request.bad_words or None,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        structured_outputs=structured_outputs,
    )


def checked_sampling_params(renamed: Mapping[str, str], **fields: Any) -> SamplingParams:
    """``SamplingParams(**fields)``; a refusal is a 400 naming the request's field, which
    ``renamed`` maps from the engine's name where the two differ."""
    try:
        return SamplingParams(**fields)
    except ValueError as error:
        openai_error = from_engine_error(error)
        if openai_error.param is not None:
            openai_error.param = renamed.get(openai_error.param, openai_error.param)
        raise openai_error from error


def given(value: Any, defaults: Mapping[str, Any], name: str, fallback: Any) -> Any:
    """The request's value, else the model's default, else OpenAI's."""
    if value is not None:
        return value
    return defaults.get(name, fallback)


def capped_max_tokens(max_tokens: int | None, defaults: Mapping[str, Any]) -> int | None:
    """A generation config's ``max_new_tokens`` caps ``max_tokens`` even when the request
    sets it (as vLLM); 0 (the prompt's logprobs alone) stays 0."""
    cap = defaults.get("max_tokens")
    if cap is None or max_tokens == 0:
        return max_tokens
    return cap if max_tokens is None else min(max_tokens, cap)


def echo_logprobs(request: GenerationRequest) -> bool:
    """Completions whose echoed prompt reports its tokens' logprobs."""
    return (
        isinstance(request, CompletionRequest)
        and bool(request.echo)
        and request.logprobs is not None
    )


def _logprobs_of(request: GenerationRequest) -> tuple[int | None, str]:
    """The engine's ``logprobs`` (top k per generated token) and the field that set it."""
    if isinstance(request, CompletionRequest):
        return request.logprobs, "logprobs"
    if request.top_logprobs and not request.logprobs:
        raise bad_request(
            "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"
        )
    return (request.top_logprobs or 0 if request.logprobs else None), "top_logprobs"


def _prompt_logprobs_of(request: GenerationRequest, max_tokens: int | None) -> int | None:
    if request.prompt_logprobs is not None and request.stream:
        raise bad_request(
            "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs"
        )
    if request.prompt_logprobs is not None:
        return request.prompt_logprobs
    if isinstance(request, CompletionRequest) and request.echo:
        if request.logprobs is not None:
            return request.logprobs
        if max_tokens == 0:
            return 0  # the engine only prefills; the echoed prompt is the whole answer
    if isinstance(request, ChatCompletionRequest) and request.echo:
        # vLLM's chat: echo also answers the prompt's logprobs (top_logprobs of them) in
        # the response's prompt_logprobs; a stream or a beam search never carries them.
        if not (request.stream or request.use_beam_search):
            return request.top_logprobs or 0
    return None


def _check_best_of(request: GenerationRequest) -> None:
    best_of = getattr(request, "best_of", None)
    n = 1 if request.n is None else request.n
    if best_of is not None and best_of != n:
        raise bad_request(
            f"best_of must be omitted or equal to n (got best_of={best_of}, n={n}): this "
            "server returns every completion it generates and does not rank extra "
            "candidates; ask for n completions instead.",
            "best_of",
        )
