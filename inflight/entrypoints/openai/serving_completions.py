"""``POST /v1/completions``: one engine request per prompt, JSON or server-sent events.

``prompt`` may be a string, a list of strings, a list of token ids, or a list of token-id
lists (as in vLLM); with ``n`` completions per prompt, completion ``j`` of prompt ``i``
is choice ``index`` ``i * n + j`` (vLLM's numbering), and streamed chunks of different
choices interleave. ``logprobs`` gives OpenAI's ``logprobs`` object per choice; with
``echo`` it starts with the prompt's tokens (the first one's logprob null), which is what
evaluation harnesses score (``max_tokens: 0`` returns the prompt alone).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request, Response

from inflight.engine.request_stream import (
    EngineDeadError,
    RequestDelta,
    RequestStream,
    StreamDroppedError,
)
from inflight.entrypoints.openai.errors import bad_request
from inflight.entrypoints.openai.logprobs import (
    CompletionLogprobsBuilder,
    merge,
    prompt_logprobs_body,
)
from inflight.entrypoints.openai.params import (
    check_length,
    check_prompt_ids,
    check_supported,
    echo_logprobs,
    sampling_params,
    truncate_prompt,
)
from inflight.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from inflight.entrypoints.openai.serving import (
    SSE_DONE,
    Collected,
    Completion,
    EngineStreamingResponse,
    ServerState,
    add_requests,
    collect_all,
    engine_failure,
    json_response,
    merge_streams,
    off_loop,
    parse_body,
    sse,
    stream_error_event,
    until_disconnect,
)
from inflight.entrypoints.openai.serving_beam_search import beam_search_streams
from inflight.entrypoints.openai.structured import structured_outputs_of
from inflight.outputs import PromptLogprobs

Prompt = tuple[str | None, list[int]]


async def create_completion(state: ServerState, raw: Request) -> Response:
    arrival_time = time.monotonic()
    request = await parse_body(raw, CompletionRequest)
    # From here on a client that goes away aborts whatever its request got to.
    return await until_disconnect(raw, _serve(state, request, arrival_time))


async def _serve(state: ServerState, request: CompletionRequest, arrival_time: float) -> Response:
    model = state.resolve_model(request.model)
    check_supported(request)
    prompts = await off_loop(_prepare_prompts, state, request)
    constraint = structured_outputs_of(request.response_format, request.structured_outputs)
    params = sampling_params(
        request, request.max_tokens, constraint, state.engine.default_sampling_params
    )
    request_id = f"cmpl-{request.request_id}"
    state.log_request(request_id, prompts, params)
    streams: list[RequestStream]
    if request.use_beam_search:
        streams = beam_search_streams(  # type: ignore[assignment]  # they read alike
            state.engine, request, request_id, prompts, params, request.max_tokens, arrival_time
        )
    else:
        streams = await add_requests(
            state.engine,
            request_id,
            prompts,
            params,
            request.priority,
            arrival_time,
            request.cache_salt,
            request_timeout=request.request_timeout,
        )
    try:
        echoes = await off_loop(_echoes, state, prompts) if request.echo else [""] * len(prompts)
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    tokenizer = state.engine.tokenizer
    reply = _Reply(
        request_id=request_id,
        model=model,
        n=params.n,
        echoes=echoes,
        prompt_ids=[ids for _, ids in prompts],
        return_token_ids=bool(request.return_token_ids),
        logprobs=request.logprobs is not None,
        echo_logprobs=echo_logprobs(request),
        # Only when asked for, directly or through echo with logprobs (as vLLM): an echo
        # with max_tokens 0 also computes them, to prefill, but they stay internal.
        show_prompt_logprobs=request.prompt_logprobs is not None or echo_logprobs(request),
        decode=lambda token_id: str(tokenizer.decode([token_id])),
        as_token_ids=bool(request.return_tokens_as_token_ids),
    )
    if request.stream:
        usage = _StreamUsage(
            *request.stream_usage(state.config.frontend.enable_force_include_usage)
        )
        return EngineStreamingResponse(_stream(reply, streams, usage), streams)
    return await _complete(reply, streams)


def _prepare_prompts(state: ServerState, request: CompletionRequest) -> list[Prompt]:
    """Tokenised, truncated and checked prompts (runs off the event loop)."""
    return [_checked(state, request, p) for p in _tokenize(state, request)]


def _echoes(state: ServerState, prompts: list[Prompt]) -> list[str]:
    """Per prompt: its text, for ``echo`` (runs off the event loop)."""
    return [_echo_text(state, p) for p in prompts]


@dataclass(frozen=True, slots=True)
class _Reply:
    """What every choice of the answer needs besides the engine's deltas."""

    request_id: str
    model: str
    n: int  # completions per prompt
    echoes: list[str]  # per prompt: its text when echo is set, else ""
    prompt_ids: list[list[int]]  # per prompt
    return_token_ids: bool
    logprobs: bool  # the choices carry OpenAI's logprobs object
    echo_logprobs: bool  # ... starting with the echoed prompt's tokens
    show_prompt_logprobs: bool  # the choices carry vLLM's prompt_logprobs
    decode: Callable[[int], str]  # one token's text
    as_token_ids: bool = False  # return_tokens_as_token_ids: logprob tokens as "token_id:<id>"

    def logprobs_builder(self) -> CompletionLogprobsBuilder:
        return CompletionLogprobsBuilder(self.decode, as_token_ids=self.as_token_ids)

    def prompt_token_ids(self, prompt: int) -> list[int] | None:
        return self.prompt_ids[prompt] if self.return_token_ids else None


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
    # One request's prompts share their sampling parameters: the engine ends each answer
    # where the context does, as the clamped max_tokens would.
    check_length(len(truncated), request.max_tokens, max_model_len, "prompt")
    return text, truncated


def _echo_text(state: ServerState, prompt: Prompt) -> str:
    text, token_ids = prompt
    if text is not None:
        return text
    return str(state.engine.tokenizer.decode(token_ids))


def _choice_logprobs(
    reply: _Reply,
    builder: CompletionLogprobsBuilder,
    prompt: int,
    prompt_logprobs: PromptLogprobs | None,
    completion: Completion | RequestDelta,
    with_prompt: bool,
) -> CompletionLogprobs | None:
    """The logprobs of a choice's new tokens, after the echoed prompt's when asked."""
    if not reply.logprobs:
        return None
    parts: list[CompletionLogprobs] = []
    if with_prompt and reply.echo_logprobs and prompt_logprobs is not None:
        parts.append(builder.prompt(reply.prompt_ids[prompt], prompt_logprobs))
    parts.append(builder.generated(completion.token_ids, completion.logprobs or []))
    return merge(parts)


def _choices(reply: _Reply, prompt: int, result: Collected) -> list[CompletionChoice]:
    return [
        CompletionChoice(
            index=prompt * reply.n + completion.index,
            text=reply.echoes[prompt] + completion.text,
            logprobs=_choice_logprobs(
                reply,
                reply.logprobs_builder(),
                prompt,
                result.prompt_logprobs,
                completion,
                with_prompt=True,
            ),
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            token_ids=completion.token_ids if reply.return_token_ids else None,
            prompt_logprobs=(
                prompt_logprobs_body(result.prompt_logprobs) if reply.show_prompt_logprobs else None
            ),
            prompt_token_ids=reply.prompt_token_ids(prompt),
        )
        for completion in result.completions
    ]


async def _complete(reply: _Reply, streams: list[RequestStream]) -> Response:
    try:
        results = await collect_all(streams, reply.n)
    except (EngineDeadError, StreamDroppedError) as error:
        raise engine_failure(error) from error
    choices = [c for prompt, result in enumerate(results) for c in _choices(reply, prompt, result)]
    # OpenAI's usage: each prompt counted once, every completion's tokens counted.
    prompt_tokens = sum(r.num_prompt_tokens for r in results)
    completion_tokens = sum(r.num_output_tokens for r in results)
    cached_tokens = sum(r.num_cached_tokens for r in results)
    return json_response(
        CompletionResponse(
            id=reply.request_id,
            model=reply.model,
            choices=choices,
            usage=UsageInfo.of(prompt_tokens, completion_tokens, cached_tokens),
        )
    )


@dataclass(slots=True)
class _StreamState:
    """Per prompt and per choice, what the chunks sent so far leave to do."""

    reply: _Reply
    prompt_tokens: list[int]
    cached_tokens: list[int]
    prompt_logprobs: list[PromptLogprobs | None]
    completion_tokens: dict[int, int] = field(default_factory=dict)
    started: set[int] = field(default_factory=set)  # choices whose first chunk went out
    ended: set[int] = field(default_factory=set)  # choices whose finish_reason went out
    builders: dict[int, CompletionLogprobsBuilder] = field(default_factory=dict)

    def totals(self) -> UsageInfo:
        return UsageInfo.of(
            sum(self.prompt_tokens), sum(self.completion_tokens.values()), sum(self.cached_tokens)
        )

    def choice_usage(self, choice: CompletionChoice) -> UsageInfo:
        """Continuous usage (vLLM's): the chunk's prompt and choice, not the totals."""
        prompt = choice.index // self.reply.n
        return UsageInfo.of(
            self.prompt_tokens[prompt],
            self.completion_tokens.get(choice.index, 0),
            self.cached_tokens[prompt],
        )

    def choice(self, prompt: int, delta: RequestDelta) -> CompletionChoice | None:
        """The chunk's choice for ``delta``; None when it adds nothing to an ended choice."""
        reply = self.reply
        index = prompt * reply.n + delta.index
        self.prompt_tokens[prompt] = delta.num_prompt_tokens
        self.cached_tokens[prompt] = delta.num_cached_tokens
        self.completion_tokens[index] = delta.num_output_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs[prompt] = delta.prompt_logprobs
        if index in self.ended and not delta.text and not delta.token_ids:
            return None
        first = index not in self.started
        self.started.add(index)
        if delta.finish_reason is not None:
            self.ended.add(index)
        builder = self.builders.setdefault(index, reply.logprobs_builder())
        return CompletionChoice(
            index=index,
            # the prompt is echoed once, in the choice's first chunk
            text=(reply.echoes[prompt] if first else "") + delta.text,
            logprobs=_choice_logprobs(
                reply, builder, prompt, self.prompt_logprobs[prompt], delta, with_prompt=first
            ),
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason if delta.finish_reason is not None else None,
            token_ids=list(delta.token_ids) if reply.return_token_ids else None,
            # vLLM sends a choice's prompt ids once, in its first chunk
            prompt_token_ids=reply.prompt_token_ids(prompt) if first else None,
        )


async def _stream(
    reply: _Reply, streams: list[RequestStream], usage: _StreamUsage
) -> AsyncIterator[str]:
    created = int(time.time())
    count = len(streams)
    state = _StreamState(reply, [0] * count, [0] * count, [None] * count)
    try:
        async for prompt, delta in merge_streams(streams):
            choice = state.choice(prompt, delta)
            if choice is None:
                continue
            yield sse(
                CompletionResponse(
                    id=reply.request_id,
                    created=created,
                    model=reply.model,
                    choices=[choice],
                    usage=state.choice_usage(choice) if usage.continuous else None,
                )
            )
        if usage.final:
            yield sse(
                CompletionResponse(
                    id=reply.request_id,
                    created=created,
                    model=reply.model,
                    choices=[],
                    usage=state.totals(),
                )
            )
    except (EngineDeadError, StreamDroppedError) as error:
        # The status line went out long ago: report the failure in-band, then end.
        yield stream_error_event(error)
    finally:
        for stream in streams:
            stream.close()
    yield SSE_DONE
