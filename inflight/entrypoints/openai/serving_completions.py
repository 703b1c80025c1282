"""``POST /v1/completions``: one engine request per prompt, JSON or server-sent events.

``prompt`` may be a string, a list of strings, a list of token ids, or a list of token-id
lists (as in vLLM); each prompt becomes choice ``index`` ``i`` of the answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from inflight.engine.request_stream import EngineDeadError, RequestStream
from inflight.entrypoints.openai.errors import bad_request
from inflight.entrypoints.openai.params import (
    check_length,
    check_prompt_ids,
    check_supported,
    sampling_params,
    truncate_prompt,
)
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
from inflight.entrypoints.openai.structured import structured_outputs_of

Prompt = tuple[str | None, list[int]]


async def create_completion(state: ServerState, raw: Request) -> Response:
    arrival_time = time.monotonic()
    request = await parse_body(raw, CompletionRequest)
    model = state.resolve_model(request.model)
    check_supported(request)
    prompts = [_checked(state, request, p) for p in _tokenize(state, request)]
    constraint = structured_outputs_of(request.response_format, request.structured_outputs)
    params = sampling_params(request, request.max_tokens, constraint)
    request_id = f"cmpl-{request.request_id}"
    streams = await add_requests(
        state.engine,
        request_id,
        prompts,
        params,
        request.priority,
        arrival_time,
        request.cache_salt,
    )
    echoes = [_echo_text(state, p) if request.echo else "" for p in prompts]
    prompt_ids = [ids for _, ids in prompts] if request.return_token_ids else None
    reply = _Reply(request_id, model, echoes, prompt_ids)
    if request.stream:
        usage = _StreamUsage(request.include_usage, request.continuous_usage)
        events = _stream(reply, streams, usage)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    return await until_disconnect(raw, _complete(reply, streams))


@dataclass(frozen=True, slots=True)
class _Reply:
    """What every choice of the answer needs besides the engine's deltas."""

    request_id: str
    model: str
    echoes: list[str]  # per prompt: its text when echo is set, else ""
    prompt_token_ids: list[list[int]] | None  # per prompt, when return_token_ids is set


@dataclass(frozen=True, slots=True)
class _StreamUsage:
    final: bool  # stream_options.include_usage: a last chunk with the totals
    continuous: bool  # stream_options.continuous_usage_stats: usage on every chunk


def _tokenize(state: ServerState, request: CompletionRequest) -> list[Prompt]:
    prompt = request.prompt
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]  # type: ignore[list-item]  # one prompt of token ids
    else:
        items = list(prompt)  # type: ignore[arg-type]
    if not items or items == [""]:
        raise bad_request(
            "Either prompt or prompt_embeds must be provided and non-empty.", "prompt"
        )
    tokenizer = state.engine.tokenizer
    prompts: list[Prompt] = []
    for item in items:
        if isinstance(item, str):
            ids = tokenizer.encode(item, add_special_tokens=request.add_special_tokens)
            prompts.append((item, list(ids)))
        else:
            prompts.append((None, list(item)))
    return prompts


def _checked(state: ServerState, request: CompletionRequest, prompt: Prompt) -> Prompt:
    """The prompt truncated as asked, then checked against the vocabulary and context."""
    text, token_ids = prompt
    max_model_len = state.engine.max_model_len
    truncated = truncate_prompt(token_ids, request, max_model_len)
    if len(truncated) != len(token_ids):
        text = None  # the engine detokenizes what is left
    check_prompt_ids(truncated, state.engine.vocab_size, "prompt")
    check_length(len(truncated), request.max_tokens, max_model_len, "prompt")
    return text, truncated


def _echo_text(state: ServerState, prompt: Prompt) -> str:
    text, token_ids = prompt
    if text is not None:
        return text
    return str(state.engine.tokenizer.decode(token_ids))


async def _complete(reply: _Reply, streams: list[RequestStream]) -> Response:
    try:
        results = await asyncio.gather(*(collect(s) for s in streams))
    except EngineDeadError as error:
        raise engine_failure(error) from error
    choices = [
        CompletionChoice(
            index=i,
            text=reply.echoes[i] + text,
            finish_reason=last.finish_reason,
            stop_reason=last.stop_reason,
            token_ids=token_ids if reply.prompt_token_ids is not None else None,
            prompt_token_ids=reply.prompt_token_ids[i] if reply.prompt_token_ids else None,
        )
        for i, (text, token_ids, last) in enumerate(results)
    ]
    prompt_tokens = sum(last.num_prompt_tokens for _, _, last in results)
    completion_tokens = sum(last.num_output_tokens for _, _, last in results)
    cached_tokens = sum(last.num_cached_tokens for _, _, last in results)
    return json_response(
        CompletionResponse(
            id=reply.request_id,
            model=reply.model,
            choices=choices,
            usage=UsageInfo.of(prompt_tokens, completion_tokens, cached_tokens),
        )
    )


async def _stream(
    reply: _Reply, streams: list[RequestStream], usage: _StreamUsage
) -> AsyncIterator[str]:
    created = int(time.time())
    echoes = list(reply.echoes)
    first = [True] * len(streams)
    prompt_tokens = [0] * len(streams)
    completion_tokens = [0] * len(streams)
    cached_tokens = [0] * len(streams)

    def totals() -> UsageInfo:
        return UsageInfo.of(sum(prompt_tokens), sum(completion_tokens), sum(cached_tokens))

    try:
        async for index, delta in merge_streams(streams):
            prompt_tokens[index] = delta.num_prompt_tokens
            completion_tokens[index] = delta.num_output_tokens
            cached_tokens[index] = delta.num_cached_tokens
            want_ids = reply.prompt_token_ids is not None
            choice = CompletionChoice(
                index=index,
                text=echoes[index] + delta.text,
                finish_reason=delta.finish_reason if delta.finished else None,
                stop_reason=delta.stop_reason if delta.finished else None,
                token_ids=list(delta.token_ids) if want_ids else None,
                # vLLM sends a choice's prompt ids once, in its first chunk
                prompt_token_ids=(
                    reply.prompt_token_ids[index]
                    if reply.prompt_token_ids is not None and first[index]
                    else None
                ),
            )
            echoes[index] = ""  # the prompt is echoed once, in the first chunk
            first[index] = False
            yield sse(
                CompletionResponse(
                    id=reply.request_id,
                    created=created,
                    model=reply.model,
                    choices=[choice],
                    usage=totals() if usage.continuous else None,
                )
            )
        if usage.final:
            yield sse(
                CompletionResponse(
                    id=reply.request_id,
                    created=created,
                    model=reply.model,
                    choices=[],
                    usage=totals(),
                )
            )
    except EngineDeadError as error:
        # The status line went out long ago: report the failure in-band, then end.
        yield sse(engine_failure(error).body())
    finally:
        for stream in streams:
            stream.close()
    yield SSE_DONE
