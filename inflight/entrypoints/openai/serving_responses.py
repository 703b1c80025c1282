"""``POST /v1/responses``: OpenAI's Responses API on the chat machinery.

The request is put in chat terms (``responses_input.py``), rendered by chat's renderer,
constrained by the same grammars and parsed by the same tool-call parser, so a greedy
answer equals ``/v1/chat/completions``' for the same messages. The answer is a Response
object whose ``output`` holds a ``message`` item (the text, unless the answer is only
tool calls) and a ``function_call`` item per call.

With ``stream: true`` the answer is OpenAI's typed server-sent events
(``responses_stream.py``).

Nothing is stored, vLLM's default: ``store: true`` is accepted and turned off;
``previous_response_id`` and ``background`` are refused (``request_fields.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request, Response

from inflight.engine.request_stream import EngineDeadError, RequestStream, StreamDroppedError
from inflight.entrypoints.openai.logprobs import chat_logprobs
from inflight.entrypoints.openai.params import (
    capped_max_tokens,
    check_length,
    check_prompt_ids,
    checked_sampling_params,
    given,
)
from inflight.entrypoints.openai.protocol import ChatTokenLogprob
from inflight.entrypoints.openai.protocol_responses import (
    FunctionCall,
    IncompleteDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseError,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
)
from inflight.entrypoints.openai.request_fields import (
    RESPONSES_FIELDS,
    log_unknown_fields,
    refuse_unsupported,
)
from inflight.entrypoints.openai.responses_input import (
    chat_input,
    chat_tool_choice,
    chat_tools,
    response_format,
    wants_logprobs,
)
from inflight.entrypoints.openai.responses_stream import (
    item_status,
    new_item_id,
    response_status,
    stream_response,
)
from inflight.entrypoints.openai.serving import (
    EngineStreamingResponse,
    ServerState,
    add_requests,
    collect,
    engine_failure,
    json_response,
    off_loop,
    parse_body,
    until_disconnect,
)
from inflight.entrypoints.openai.serving_chat import chat_options, render_messages
from inflight.entrypoints.openai.structured import structured_outputs_of
from inflight.entrypoints.openai.tool_calls import (
    FunctionTool,
    ToolChoice,
    answer_constraint,
    parse_tool_choice,
    parse_tools,
    tool_answer_params,
)
from inflight.entrypoints.openai.tool_parsing import ToolCallStreamer, parse_answer
from inflight.model.token_bytes import TokenBytes, token_bytes_of
from inflight.outputs import SampleLogprobs
from inflight.sampling_params import SamplingParams, StructuredOutputsParams

# The engine's names for the request's fields, where they differ (for 400s).
_RENAMED = {"logprobs": "top_logprobs", "max_tokens": "max_output_tokens"}


async def create_response(state: ServerState, raw: Request) -> Response:
    arrival_time = time.monotonic()
    request = await parse_body(raw, ResponsesRequest)
    # From here on a client that goes away aborts whatever its request got to.
    return await until_disconnect(raw, _serve(state, request, arrival_time))


async def _serve(state: ServerState, request: ResponsesRequest, arrival_time: float) -> Response:
    model = state.resolve_model(request.model)
    log_unknown_fields(request, "/v1/responses")
    refuse_unsupported(request, RESPONSES_FIELDS)
    tools = parse_tools(chat_tools(request.tools), flat=True)
    tool_choice = parse_tool_choice(chat_tool_choice(request.tool_choice), tools)
    text_format = structured_outputs_of(
        response_format(request.text), request.structured_outputs, "text.format"
    )
    constraint = answer_constraint(
        tools, tool_choice, text_format, "text.format",
        parallel=request.parallel_tool_calls is not False,
    )
    params = tool_answer_params(
        _sampling_params(request, constraint, state.engine.default_sampling_params), tool_choice
    )
    token_ids = await off_loop(_prompt_ids, state, request, tools)
    max_model_len = state.engine.max_model_len
    check_length(len(token_ids), request.max_output_tokens, max_model_len, "input")
    room = max_model_len - len(token_ids)  # the engine ends the answer there
    state.log_request(request.request_id, [(None, token_ids)], params)
    (stream,) = await add_requests(
        state.engine,
        request.request_id,
        [(None, token_ids)],
        params,
        request.priority,
        arrival_time,
        request.cache_salt,
        logprobs_param="top_logprobs",
        request_timeout=request.request_timeout,
    )
    tokenizer = state.engine.tokenizer
    reply = ResponseReply(
        request=request,
        model=model,
        params=params,
        # vLLM echoes the effective limit: at most what the context leaves.
        max_output_tokens=min(params.max_tokens or room, room),
        tools=tools,
        tool_choice=tool_choice,
        decode=lambda token_id: str(tokenizer.decode([token_id])),
        raw_bytes=token_bytes_of(tokenizer),
    )
    if request.stream:
        return EngineStreamingResponse(stream_response(reply, stream), [stream])
    return await _complete(reply, stream)


def _sampling_params(
    request: ResponsesRequest,
    constraint: StructuredOutputsParams | None,
    defaults: Mapping[str, Any],
) -> SamplingParams:
    """The engine's parameters; where the request is silent, the model's generation config
    (``defaults``), else OpenAI's, as on chat. Logprobs only when ``include`` asks for them
    (vLLM's rule)."""
    logprobs = (request.top_logprobs or 0) if wants_logprobs(request.include) else None
    return checked_sampling_params(
        _RENAMED,
        temperature=given(request.temperature, defaults, "temperature", 1.0),
        top_p=given(request.top_p, defaults, "top_p", 1.0),
        top_k=given(request.top_k, defaults, "top_k", 0),
        min_p=given(request.min_p, defaults, "min_p", 0.0),
        seed=request.seed,
        max_tokens=capped_max_tokens(request.max_output_tokens, defaults),
        stop=request.stop,
        stop_token_ids=request.stop_token_ids,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        ignore_eos=request.ignore_eos,
        skip_special_tokens=request.skip_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        repetition_penalty=given(request.repetition_penalty, defaults, "repetition_penalty", 1.0),
        logit_bias=dict(request.logit_bias) if request.logit_bias else None,
        logprobs=logprobs,
        structured_outputs=constraint,
    )


def _prompt_ids(
    state: ServerState, request: ResponsesRequest, tools: Sequence[FunctionTool]
) -> list[int]:
    """The input's token ids, rendered as chat renders the same messages (runs off the
    event loop: its cost grows with the input)."""
    conversation = chat_input(request.instructions, request.input)
    continued = conversation.continue_final_message
    options = chat_options(
        add_generation_prompt=not continued,
        continue_final_message=continued,
        chat_template_kwargs=request.chat_template_kwargs,
    )
    token_ids = render_messages(
        state, conversation.messages, options, tools, "input"
    ).prompt_token_ids
    check_prompt_ids(token_ids, state.engine.vocab_size, "input")
    return token_ids


@dataclass(slots=True)
class ResponseReply:
    """What the answer carries besides the engine's deltas."""

    request: ResponsesRequest
    model: str
    params: SamplingParams
    max_output_tokens: int
    tools: Sequence[FunctionTool]
    tool_choice: ToolChoice
    decode: Callable[[int], str]
    raw_bytes: TokenBytes | None
    created_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def parallel_tool_calls(self) -> bool:
        return self.request.parallel_tool_calls is not False

    def streamer(self) -> ToolCallStreamer:
        return ToolCallStreamer(self.tools, self.tool_choice, self.parallel_tool_calls)

    def logprobs(
        self, token_ids: Sequence[int], logprobs: SampleLogprobs | None
    ) -> list[ChatTokenLogprob] | None:
        """The tokens' entries when the request includes logprobs (chat's shape)."""
        top = self.params.logprobs
        if top is None:
            return None
        return chat_logprobs(token_ids, logprobs or [], top, self.decode, False, self.raw_bytes)

    def response(
        self,
        status: str,
        output: Sequence[OutputItem] = (),
        usage: ResponseUsage | None = None,
        error: ResponseError | None = None,
    ) -> ResponsesResponse:
        """The Response object, with the request's settings echoed."""
        request = self.request
        incomplete = IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
        return ResponsesResponse(
            id=request.request_id,
            created_at=self.created_at,
            status=status,
            error=error,
            incomplete_details=incomplete,
            model=self.model,
            output=list(output),
            usage=usage,
            instructions=request.instructions,
            max_output_tokens=self.max_output_tokens,
            max_tool_calls=request.max_tool_calls,
            temperature=self.params.temperature,
            top_p=self.params.top_p,
            presence_penalty=self.params.presence_penalty,
            frequency_penalty=self.params.frequency_penalty,
            top_logprobs=self.params.logprobs,
            tools=request.tools or [],
            tool_choice=request.tool_choice or "auto",
            parallel_tool_calls=self.parallel_tool_calls,
            text=request.text or {"format": {"type": "text"}},
            truncation=request.truncation or "disabled",
            metadata=request.metadata or {},
            user=request.user,
            safety_identifier=request.safety_identifier,
            prompt_cache_key=request.prompt_cache_key,
            service_tier=request.service_tier or "auto",
        )


async def _complete(reply: ResponseReply, stream: RequestStream) -> Response:
    try:
        result = await collect(stream)
    except (EngineDeadError, StreamDroppedError) as error:
        raise engine_failure(error) from error
    completion = result.completions[0]
    answer = parse_answer(
        completion.text, reply.tools, reply.tool_choice, reply.parallel_tool_calls
    )
    cut = item_status(completion.finish_reason)  # the last item's, and the calls'
    output: list[OutputItem] = []
    if answer.content or not answer.calls:
        logprobs = reply.logprobs(completion.token_ids, completion.logprobs)
        if logprobs is not None and answer.calls:  # the text's tokens, not the calls'
            logprobs = logprobs[: tokens_spelling(logprobs, answer.content or "")]
        text = OutputText(text=answer.content or "", logprobs=logprobs)
        # A message before calls was complete when they began.
        status = "completed" if answer.calls else cut
        output.append(OutputMessage(id=new_item_id("msg"), status=status, content=[text]))
    for call in answer.calls:
        output.append(
            FunctionCall(
                id=new_item_id("fc"),
                call_id=call.id,
                name=call.name,
                arguments=call.arguments,
                status=cut,
            )
        )
    usage = ResponseUsage.of(result.num_prompt_tokens, result.num_output_tokens, result.num_cached_tokens)
    return json_response(reply.response(response_status(completion.finish_reason), output, usage))


def tokens_spelling(entries: Sequence[ChatTokenLogprob], text: str) -> int:
    """How many leading tokens it takes to spell ``text`` (counted in UTF-8 bytes): a
    message's logprobs before a tool call are those of its own tokens, the token that
    also starts the call included, as the streamed text deltas carry them."""
    needed, count = len(text.encode("utf-8")), 0
    for count, entry in enumerate(entries, start=1):
        needed -= len(entry.bytes or [])
        if needed <= 0:
            return count
    return count
