"""From a validated API request to the engine's :class:`SamplingParams`.

Owns the rules that pydantic cannot express: options the engine does not implement
(``n > 1``, logprobs, penalties, ...) are refused by name instead of silently ignored, and
``prompt + max_tokens`` must fit in ``max_model_len`` as in vLLM.
"""

from __future__ import annotations

from inflight.entrypoints.openai.errors import bad_request, from_engine_error
from inflight.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from inflight.sampling_params import SamplingParams


def check_supported(request: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuse, by parameter name, features the engine does not implement yet."""
    unsupported: list[tuple[str, bool]] = [
        ("n", (request.n or 1) != 1),
        ("logit_bias", bool(request.logit_bias)),
        ("stream_options", request.stream_options is not None and not request.stream),
    ]
    if isinstance(request, CompletionRequest):
        unsupported += [
            ("logprobs", request.logprobs is not None),
            ("best_of", (request.best_of or 1) != 1),
            ("suffix", bool(request.suffix)),
        ]
    else:
        response_type = (request.response_format or {}).get("type", "text")
        unsupported += [
            ("logprobs", request.logprobs or request.top_logprobs is not None),
            ("tools", bool(request.tools)),
            ("response_format", response_type != "text"),
        ]
    for param, refused in unsupported:
        if refused:
            if param == "stream_options":
                raise bad_request(
                    "The 'stream_options' parameter is only allowed when 'stream' is true.",
                    param,
                )
            raise bad_request(
                f"'{param}' is not supported by this server yet.", param, "unsupported_parameter"
            )


def max_tokens_of(request: CompletionRequest | ChatCompletionRequest) -> int | None:
    if isinstance(request, ChatCompletionRequest):
        return request.max_completion_tokens or request.max_tokens
    return request.max_tokens


def check_length(
    num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, param: str
) -> None:
    """A prompt longer than the context, or prompt + max_tokens past it, is a 400."""
    if num_prompt_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt "
            f"has {num_prompt_tokens} tokens. Please shorten it.",
            param,
            "context_length_exceeded",
        )
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"prompt, {max_tokens} for the completion). Please reduce the prompt or max_tokens.",
            "max_tokens",
            "context_length_exceeded",
        )


def sampling_params(
    request: CompletionRequest | ChatCompletionRequest, max_tokens: int | None
) -> SamplingParams:
    """OpenAI defaults where the request is silent; engine errors become 400s."""
    try:
        return SamplingParams(
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=request.top_k or 0,
            min_p=request.min_p or 0.0,
            seed=request.seed,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos,
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            repetition_penalty=(
                1.0 if request.repetition_penalty is None else request.repetition_penalty
            ),
            skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
        )
    except ValueError as error:
        raise from_engine_error(error) from error
