"""``POST /v1/completions``: one engine request per prompt, JSON or server-sent events.

``prompt`` may be a string, a list of strings, a list of token ids, or a list of token-id
lists (as in vLLM); each prompt becomes choice ``index`` ``i`` of the answer.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from inflight.engine.request_stream import EngineDeadError, RequestStream
from inflight.entrypoints.openai.errors import bad_request
from inflight.entrypoints.openai.params import check_length, check_supported, sampling_params
from inflight.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
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
    merge_streams,
    parse_body,
    sse,
    until_disconnect,
)

Prompt = tuple[str | None, list[int]]


async def create_completion(state: ServerState, raw: Request) -> Response:
    arrival_time = time.monotonic()
    request = await parse_body(raw, CompletionRequest)
    model = state.resolve_model(request.model)
    check_supported(request)
    prompts = _tokenize(state, request)
    for _, token_ids in prompts:
        check_length(len(token_ids), request.max_tokens, state.engine.max_model_len, "prompt")
    params = sampling_params(request, request.max_tokens)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = await add_requests(
        state.engine,
        request_id,
        prompts,
        params,
        request.priority,
        arrival_time,
    )
    echoes = [_echo_text(state, p) if request.echo else "" for p in prompts]
    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        events = _stream(request_id, model, streams, echoes, include_usage)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    return await until_disconnect(raw, _complete(request_id, model, streams, echoes))


def _tokenize(state: ServerState, request: CompletionRequest) -> list[Prompt]:
    prompt = request.prompt
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]  # type: ignore[list-item]  # one prompt of token ids
    else:
        items = list(prompt)  # type: ignore[arg-type]
    if not items:
        raise bad_request("'prompt' must not be empty.", "prompt")
    prompts: list[Prompt] = []
    for item in items:
        if isinstance(item, str):
            prompts.append(state.engine.tokenize_prompt(item))
        else:
            prompts.append((None, list(item)))
    return prompts


def _echo_text(state: ServerState, prompt: Prompt) -> str:
    text, token_ids = prompt
    if text is not None:
        return text
    return str(state.engine.tokenizer.decode(token_ids))


async def _complete(
    request_id: str,
    model: str,
    streams: list[RequestStream],
    echoes: list[str],
) -> Response:
    try:
        results = await asyncio.gather(*(collect(s) for s in streams))
    except EngineDeadError as error:
        raise engine_failure(error) from error
    choices = [
        CompletionChoice(
            index=i,
            text=echoes[i] + text,
            finish_reason=last.finish_reason,
            stop_reason=last.stop_reason,
        )
        for i, (text, last) in enumerate(results)
    ]
    prompt_tokens = sum(last.num_prompt_tokens for _, last in results)
    completion_tokens = sum(last.num_output_tokens for _, last in results)
    return json_response(
        CompletionResponse(
            id=request_id,
            model=model,
            choices=choices,
            usage=UsageInfo(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens,
            ),
        )
    )


async def _stream(
    request_id: str,
    model: str,
    streams: list[RequestStream],
    echoes: list[str],
    include_usage: bool,
) -> AsyncIterator[str]:
    created = int(time.time())
    prompt_tokens = [0] * len(streams)
    completion_tokens = [0] * len(streams)
    try:
        async for index, delta in merge_streams(streams):
            text = echoes[index] + delta.text
            echoes[index] = ""  # the prompt is echoed once, in the first chunk
            prompt_tokens[index] = delta.num_prompt_tokens
            completion_tokens[index] = delta.num_output_tokens
            choice = CompletionChoice(
                index=index,
                text=text,
                finish_reason=delta.finish_reason if delta.finished else None,
                stop_reason=delta.stop_reason if delta.finished else None,
            )
            yield sse(
                CompletionResponse(id=request_id, created=created, model=model, choices=[choice])
            )
        if include_usage:
            usage = UsageInfo(
                prompt_tokens=sum(prompt_tokens),
                completion_tokens=sum(completion_tokens),
                total_tokens=sum(prompt_tokens) + sum(completion_tokens),
            )
            yield sse(
                CompletionResponse(
                    id=request_id, created=created, model=model, choices=[], usage=usage
                )
            )
    except EngineDeadError as error:
        # The status line went out long ago: report the failure in-band, then end.
        yield sse(engine_failure(error).body())
    finally:
        for stream in streams:
            stream.close()
    yield SSE_DONE
