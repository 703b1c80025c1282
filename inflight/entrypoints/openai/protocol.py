"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Requests declare every field of OpenAI's and vLLM's schemas; what the server does with
each one is in ``request_fields.py`` (implemented, or refused by name when set to a
non-neutral value). Fields are parsed strictly from JSON (``"5"`` is not an integer,
``true`` is not a number) with OpenAI's ranges; fields in neither schema are kept in
``model_extra`` only to be logged and ignored.

Responses carry vLLM's fields even when null (``stop_reason``, ``prompt_logprobs``,
``prompt_token_ids``, ``token_ids``, ...), so clients written against vLLM find them.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# Any ints: a negative id is out of vocabulary (params.check_prompt_ids says so), not a
# prompt of the wrong type.
TokenIds = list[int]
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# Field types several requests share, with OpenAI's ranges.
INT64 = Annotated[int, Field(ge=_INT64_MIN, le=_INT64_MAX)]
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
LogitBias = dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]]
# vLLM's render-endpoint option: what a multimodal item's features carry.
MMPayload = Literal["tensors", "none"]


def random_request_id() -> str:
    return uuid.uuid4().hex


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Request):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage on every chunk
    include_obfuscation: bool | None = None  # OpenAI's; no obfuscation padding is sent


class _GenerationFields(_Request):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's)."""

    model: str | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    # OpenAI's limit: one request must not be able to fill the engine for minutes.
    n: Annotated[int, Field(ge=1, le=128)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: INT64 | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    logit_bias: LogitBias | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's sampling extras
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    use_beam_search: bool = False
    length_penalty: float = 1.0
    watermarking: bool | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    allowed_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | None = (
        None
    )
    bad_words: list[str] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0)] | None = None
    logprob_token_ids: list[int] | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's extra parameters
    priority: INT64 = 0
    request_id: str = Field(default_factory=random_request_id)
    session_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    routed_experts_prompt_start: Annotated[int, Field(ge=0)] = 0
    return_token_offsets: bool | None = False
    return_mm_kwargs: bool | None = None  # vLLM's deprecated alias of mm_payload
    mm_payload: MMPayload = "tensors"
    cache_salt: Annotated[str, Field(min_length=1, max_length=1024)] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    repetition_detection: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    stream_interval: Annotated[int, Field(ge=1)] | None = None
    # inflight's extension: seconds from arrival after which the request is aborted (504)
    request_timeout: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's rule: usage on every chunk only with include_usage as well."""
        return self.include_usage and bool(
            self.stream_options and self.stream_options.continuous_usage_stats
        )

    def stream_usage(self, force: bool) -> tuple[bool, bool]:
        """(a last usage chunk, usage on every chunk) for a stream; ``force`` is vLLM's
        ``--enable-force-include-usage``: both, whatever stream_options says (vLLM 0.32's
        ``should_include_usage``)."""
        if force:
            return True, True
        return self.include_usage, self.continuous_usage


class CompletionRequest(_GenerationFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    # 0 only with echo or prompt_logprobs: the prompt's logprobs alone (lm-eval scoring)
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    echo: bool | None = False
    logprobs: Annotated[int, Field(ge=0)] | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    suffix: str | None = None
    prompt_embeds: Any = None
    add_special_tokens: bool = True


class ContentPart(_Request):
    """A part of a message's content; only ``text`` parts are rendered (chat_utils)."""

    type: str
    text: str | None = None


class CalledFunction(_Request):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI's JSON text; an object is taken too

    @field_validator("arguments")
    @classmethod
    def _json_arguments(cls, value: str | dict[str, Any]) -> str | dict[str, Any]:
        """JSON text, as vLLM requires before rendering (it parses them; "" means {})."""
        if isinstance(value, str):
            if not value:
                return "{}"
            try:
                json.loads(value)
            except ValueError as error:
                raise ValueError(f"function arguments must be JSON text: {error}") from None
        return value


class MessageToolCall(_Request):
    """A call an earlier assistant message made (OpenAI's shape; ``id`` may be left out)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Request):
    """One message; keys beside these are passed to the template as given."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None

    def as_dict(self) -> dict[str, Any]:
        message = self.model_dump(exclude_unset=True)
        if self.tool_calls is not None:  # whole, defaults included, as templates read them
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        return message


class ChatCompletionRequest(_GenerationFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    reasoning_effort: str | None = None
    include_reasoning: bool = True
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    verbosity: str | None = None
    moderation: Any = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # vLLM's chat extras
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    return_prompt_text: bool | None = None


class TokenizeRequest(_Request):
    """``prompt`` text, or chat ``messages`` rendered with the chat template first."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    tools: list[dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------- responses


class _Response(BaseModel):
    pass


class UsageInfo(_Response):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: dict[str, int] | None = None
    completion_tokens_details: dict[str, int] | None = None  # vLLM's: reasoning tokens

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
        """OpenAI's usage; ``prompt_tokens_details.cached_tokens`` counts the prompt tokens
        served from the prefix cache."""
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details={"cached_tokens": cached_tokens},
        )


class LogprobInfo(_Response):
    """vLLM's ``Logprob`` in ``prompt_logprobs``: rank 1 is the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's ``prompt_logprobs``: per prompt token, token id -> logprob; the first entry null.
PromptLogprobsBody = list[dict[int, LogprobInfo] | None]


class CompletionLogprobs(_Response):
    """OpenAI's completions ``logprobs``: per token its text, logprob, the most likely
    tokens (the sampled one always included) and where it starts in the choice's text.
    With ``echo`` the prompt's tokens come first, the very first with null logprobs."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobsBody | None = None
    prompt_token_ids: list[int] | None = None
    routed_experts: None = None  # vLLM's (mixture-of-experts routing): no experts here


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    service_tier: str | None = None
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None
    kv_transfer_params: None = None
    ec_transfer_params: None = None
    metrics: None = None  # vLLM's per-request metrics, off as by vLLM's default


class ChatResponseMessage(_Response):
    role: str = "assistant"
    content: str | None = None
    refusal: str | None = None
    annotations: None = None
    audio: None = None
    function_call: None = None
    tool_calls: list[Any] = Field(default_factory=list)
    reasoning: str | None = None
    reasoning_content: str | None = None  # vLLM's older name for ``reasoning``


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    routed_experts: None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    service_tier: str | None = None
    system_fingerprint: str | None = None
    usage: UsageInfo
    prompt_logprobs: PromptLogprobsBody | None = None
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
    kv_transfer_params: None = None
    ec_transfer_params: None = None
    metrics: None = None


class ChatDelta(_Response):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[Any] = Field(default_factory=list)


class ChatChunkChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "inflight"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Response):
    prompt: str


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    """Every 4xx/5xx body (``errors.py``), as published in the OpenAPI schema."""

    error: ErrorInfo
