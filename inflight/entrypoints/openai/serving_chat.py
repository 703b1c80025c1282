"""``POST /v1/chat/completions``: render the chat template, generate, JSON or SSE.

The prompt is built exactly as ``LLM.chat`` builds it (template rendered to text, then
encoded without extra special tokens), so greedy answers match the offline API's.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from inflight.engine.request_stream import EngineDeadError, RequestStream
from inflight.entrypoints.openai.errors import bad_request
from inflight.entrypoints.openai.params import (
    check_length,
    check_supported,
    max_tokens_of,
    sampling_params,
)
from inflight.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessage,
    ChatResponseMessage,
    UsageInfo,
)
from inflight.entrypoints.openai.serving import (
    SSE_DONE,
    SSE_HEADERS,
    ServerState,
    add_requests,
    collect,
    engine_failure,
    json_response,
    parse_body,
    sse,
    until_disconnect,
)


async def create_chat_completion(state: ServerState, raw: Request) -> Response:
    arrival_time = time.monotonic()
    request = await parse_body(raw, ChatCompletionRequest)
    model = state.resolve_model(request.model)
    check_supported(request)
    token_ids = render_chat(
        state.engine.tokenizer,
        request.messages,
        request.chat_template or state.config.chat_template,
        request.add_generation_prompt,
    )
    max_tokens = max_tokens_of(request)
    check_length(len(token_ids), max_tokens, state.engine.max_model_len, "messages")
    params = sampling_params(request, max_tokens)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    (stream,) = await add_requests(
        state.engine,
        request_id,
        [(None, token_ids)],
        params,
        request.priority,
        arrival_time,
    )
    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        events = _stream(request_id, model, stream, include_usage)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    return await until_disconnect(raw, _complete(request_id, model, stream))


def render_chat(
    tokenizer: Any,
    messages: Sequence[ChatMessage],
    chat_template: str | None,
    add_generation_prompt: bool,
) -> list[int]:
    """The conversation as prompt token ids, through the (given or model's) template."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise bad_request(
            "This model has no chat template: start the server with --chat-template, or pass "
            "'chat_template' in the request.",
            "messages",
        )
    conversation = [
        {"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
        for m in messages
    ]
    try:
        rendered = tokenizer.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
        )
    except Exception as error:  # a template raising (jinja's raise_exception) or broken
        raise bad_request(
            f"The chat template failed on these messages: {error}", "messages"
        ) from error
    return list(tokenizer.encode(rendered, add_special_tokens=False))


async def _complete(request_id: str, model: str, stream: RequestStream) -> Response:
    try:
        text, last = await collect(stream)
    except EngineDeadError as error:
        raise engine_failure(error) from error
    choice = ChatChoice(
        index=0,
        message=ChatResponseMessage(content=text),
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
    )
    return json_response(
        ChatCompletionResponse(
            id=request_id,
            model=model,
            choices=[choice],
            usage=UsageInfo(
                prompt_tokens=last.num_prompt_tokens,
                completion_tokens=last.num_output_tokens,
                total_tokens=last.num_prompt_tokens + last.num_output_tokens,
            ),
        )
    )


async def _stream(
    request_id: str,
    model: str,
    stream: RequestStream,
    include_usage: bool,
) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
        return sse(
            ChatCompletionChunk(
                id=request_id, created=created, model=model, choices=choices, usage=usage
            )
        )

    try:
        # OpenAI's first chunk carries the role and no text.
        yield chunk([ChatChunkChoice(index=0, delta=ChatDelta(role="assistant", content=""))])
        last = None
        async for delta in stream:
            last = delta
            yield chunk(
                [
                    ChatChunkChoice(
                        index=0,
                        delta=ChatDelta(content=delta.text),
                        finish_reason=delta.finish_reason if delta.finished else None,
                        stop_reason=delta.stop_reason if delta.finished else None,
                    )
                ]
            )
        if include_usage and last is not None:
            yield chunk(
                [],
                UsageInfo(
                    prompt_tokens=last.num_prompt_tokens,
                    completion_tokens=last.num_output_tokens,
                    total_tokens=last.num_prompt_tokens + last.num_output_tokens,
                ),
            )
    except EngineDeadError as error:
        yield sse(engine_failure(error).body())
    finally:
        stream.close()
    yield SSE_DONE
