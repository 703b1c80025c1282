"""Request and response bodies of ``POST /v1/responses`` (OpenAI's Responses API).

The request declares every field of OpenAI's ``ResponseCreateParams`` and of vLLM's
``ResponsesRequest`` extras; ``request_fields.RESPONSES_FIELDS`` says what the server does
with each. Parsing is strict, as for the other routes (``protocol.py``). Input items,
tools and ``text`` stay plain JSON here: ``serving_responses.py`` checks them item by
item, so a 400 can say which item is wrong.

The answer is OpenAI's ``Response`` object, with the request's settings echoed as vLLM
echoes them (the effective ``temperature``, ``top_p``, ``max_output_tokens`` and
penalties), and with every key of vLLM's object (its extras null where unsupported).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from inflight.entrypoints.openai.protocol import (
    INT64,
    ChatTokenLogprob,
    LogitBias,
    MMPayload,
    Temperature,
    TopP,
    _Request,
)


def random_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


class ResponsesStreamOptions(_Request):
    """OpenAI's ``stream_options`` for responses: its one field, typed (no padding is sent)."""

    include_obfuscation: bool | None = None


class ResponsesRequest(_Request):
    # OpenAI's ResponseCreateParams
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool | None = False
    stream_options: ResponsesStreamOptions | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    store: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    max_tool_calls: Annotated[int, Field(ge=0)] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    background: bool | None = None
    background_options: dict[str, Any] | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    context_management: list[dict[str, Any]] | None = None
    access_programs: dict[str, Any] | None = None
    image: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    # vLLM's extras (ResponsesRequest)
    request_id: str = Field(default_factory=random_response_id)
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    logit_bias: LogitBias | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    seed: INT64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: INT64 = 0
    cache_salt: Annotated[str, Field(min_length=1, max_length=1024)] | None = None
    structured_outputs: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    session_id: str | None = None
    watermarking: bool | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    mm_payload: MMPayload = "tensors"
    return_mm_kwargs: bool | None = None
    enable_response_messages: bool = False
    previous_input_messages: list[Any] | None = None
    previous_response: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    # inflight's extension: seconds from arrival after which the request is aborted (504)
    request_timeout: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None


# ---------------------------------------------------------------------- the answer


class _Response(BaseModel):
    pass


class OutputText(_Response):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    # With include ["message.output_text.logprobs"]: chat's per-token entries, same shape.
    logprobs: list[ChatTokenLogprob] | None = None


class OutputMessage(_Response):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: str = "in_progress"  # in_progress, completed, or incomplete (cut by length)
    content: list[OutputText] = Field(default_factory=list)
    phase: None = None  # OpenAI's commentary / final_answer label; vLLM carries it as null


class FunctionCall(_Response):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: str = "in_progress"


OutputItem = OutputMessage | FunctionCall


class InputTokensDetails(_Response):
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    # vLLM's per-turn counts of its built-in tool loop: empty here, as in vLLM without one.
    input_tokens_per_turn: list[int] = Field(default_factory=list)
    cached_tokens_per_turn: list[int] = Field(default_factory=list)


class OutputTokensDetails(_Response):
    reasoning_tokens: int = 0
    tool_output_tokens: int = 0
    output_tokens_per_turn: list[int] = Field(default_factory=list)
    tool_output_tokens_per_turn: list[int] = Field(default_factory=list)


class ResponseUsage(_Response):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of(cls, input_tokens: int, output_tokens: int, cached_tokens: int) -> ResponseUsage:
        return cls(
            input_tokens=input_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
            output_tokens=output_tokens,
            total_tokens=input_tokens + output_tokens,
        )


class IncompleteDetails(_Response):
    reason: str


class ResponseError(_Response):
    code: str
    message: str


class ResponsesResponse(_Response):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: str  # completed, incomplete, in_progress (streamed first), failed, cancelled
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    # the request's settings
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    temperature: float
    top_p: float
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: str = "disabled"
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str = "auto"
    background: bool = False
    store: bool = False  # nothing is kept (see serving_responses.py)
    previous_response_id: None = None
    reasoning: None = None
    # vLLM's extra keys: the penalties as applied, the rest null (not supported here).
    prompt: None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    kv_transfer_params: None = None
    ec_transfer_params: None = None
    input_messages: None = None
    output_messages: None = None
