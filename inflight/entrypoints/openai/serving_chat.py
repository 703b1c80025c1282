"""``POST /v1/chat/completions``: render the chat template, generate, JSON or SSE.

The prompt is built by the same renderer as ``LLM.chat`` (``entrypoints/chat_utils.py``),
so greedy answers match the offline API's. As in vLLM, the answer's role is
``--response-role`` (``assistant``) when a generation prompt is added, else the final
message's role, and ``echo`` puts the final message's content before the answer when the
roles match.
``n`` answers are choices 0..n-1 (streamed chunks interleave by ``index``); ``logprobs``
with ``top_logprobs`` gives OpenAI's ``logprobs.content`` per choice. ``response_format`` /
``structured_outputs`` constrain the answer with a grammar (``structured.py``); ``tools``
with ``tool_choice`` are rendered and parsed by ``tool_calls.py``, each choice on its own.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request, Response

from inflight.engine.request_stream import EngineDeadError, RequestStream, StreamDroppedError
from inflight.entrypoints.chat_utils import ChatOptions, RenderedChat, render_chat
from inflight.entrypoints.openai.errors import bad_request
from inflight.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs_body
from inflight.entrypoints.openai.params import (
    check_length,
    check_prompt_ids,
    check_supported,
    max_tokens_of,
    sampling_params,
    truncate_prompt,
)
from inflight.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
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
    EngineStreamingResponse,
    ServerState,
    add_requests,
    collect,
    engine_failure,
    json_response,
    off_loop,
    parse_body,
    sse,
    stream_error_event,
    until_disconnect,
)
from inflight.entrypoints.openai.serving_beam_search import beam_search_streams
from inflight.entrypoints.openai.structured import structured_outputs_of
from inflight.entrypoints.openai.tool_calls import (
    FunctionTool,
    ToolChoice,
    answer_constraint,
    apply_tools,
    parse_tool_choice,
    parse_tools,
    tool_answer_params,
)
from inflight.entrypoints.openai.tool_parsing import ToolCallStreamer, parse_answer
from inflight.model.token_bytes import TokenBytes, token_bytes_of
from inflight.outputs import SampleLogprobs


async def create_chat_completion(state: ServerState, raw: Request) -> Response:
    arrival_time = time.monotonic()
    request = await parse_body(raw, ChatCompletionRequest)
    # From here on a client that goes away aborts whatever its request got to.
    return await until_disconnect(raw, _serve(state, request, arrival_time))


async def _serve(
    state: ServerState, request: ChatCompletionRequest, arrival_time: float
) -> Response:
    model = state.resolve_model(request.model)
    check_supported(request)
    if request.tools is not None and not request.tools:  # OpenAI's and vLLM's rule
        raise bad_request(
            "'tools' must not be an empty array: give at least one tool, or leave it out.",
            "tools",
        )
    tools = parse_tools(request.tools)
    tool_choice = parse_tool_choice(request.tool_choice, tools)
    constraint = answer_constraint(
        tools,
        tool_choice,
        structured_outputs_of(request.response_format, request.structured_outputs),
        parallel=request.parallel_tool_calls is not False,
    )
    options = chat_options(
        chat_template=request.chat_template,
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        add_special_tokens=request.add_special_tokens,
        chat_template_kwargs=request.chat_template_kwargs,
        documents=request.documents,
    )
    rendered, token_ids = await off_loop(_prepare_prompt, state, request, options, tools)
    max_tokens = check_length(
        len(token_ids), max_tokens_of(request), state.engine.max_model_len, "messages"
    )
    params = tool_answer_params(
        sampling_params(request, max_tokens, constraint, state.engine.default_sampling_params),
        tool_choice,
    )
    request_id = f"chatcmpl-{request.request_id}"
    state.log_request(request_id, [(None, token_ids)], params)
    stream: RequestStream
    if request.use_beam_search:
        (stream,) = beam_search_streams(  # type: ignore[assignment]  # they read alike
            state.engine, request, request_id, [(None, token_ids)], params, max_tokens,
            arrival_time,
        )
    else:
        (stream,) = await add_requests(
            state.engine,
            request_id,
            [(None, token_ids)],
            params,
            request.priority,
            arrival_time,
            request.cache_salt,
            logprobs_param="top_logprobs",
            request_timeout=request.request_timeout,
        )
    tokenizer = state.engine.tokenizer
    reply = _reply(request, request_id, model, rendered, token_ids, params.n, tools, tool_choice,
                   state.config.response_role)
    reply.decode = lambda token_id: str(tokenizer.decode([token_id]))
    reply.raw_bytes = token_bytes_of(tokenizer)
    if request.stream:
        force = state.config.frontend.enable_force_include_usage
        events = _stream(reply, stream, *request.stream_usage(force))
        return EngineStreamingResponse(events, [stream])
    return await _complete(reply, stream)


def _prepare_prompt(
    state: ServerState,
    request: ChatCompletionRequest,
    options: ChatOptions,
    tools: Sequence[FunctionTool],
) -> tuple[RenderedChat, list[int]]:
    """The rendered chat and its token ids, truncated and checked (runs off the loop)."""
    rendered = render_messages(state, request.messages, options, tools)
    token_ids = truncate_prompt(rendered.prompt_token_ids, request, state.engine.max_model_len)
    check_prompt_ids(token_ids, state.engine.vocab_size, "messages")
    return rendered, token_ids


def render_messages(
    state: ServerState,
    messages: list[ChatMessage],
    options: ChatOptions,
    tools: Sequence[FunctionTool] = (),
    param: str = "messages",
) -> RenderedChat:
    """The request's messages through the chat renderer; its refusals are 400s naming
    ``param`` (the field that held the messages).

    Tools go to a template that knows them, else into the messages (``tool_calls.py``).
    A template in the request is refused unless the server trusts request templates.
    """
    if options.chat_template is not None and not state.config.trust_request_chat_template:
        raise bad_request(
            "Chat template is passed with request, but --trust-request-chat-template is not "
            "set. Refused request with untrusted chat template.",
            "chat_template",
        )
    if options.chat_template is None and state.config.chat_template is not None:
        options = _with_template(options, state.config.chat_template)
    options = replace(options, content_format=state.config.chat_template_content_format)
    template = options.chat_template or getattr(state.engine.tokenizer, "chat_template", None)
    dicts, options = apply_tools([m.as_dict() for m in messages], options, tools, template)
    try:
        return render_chat(state.engine.tokenizer, dicts, options)
    except ValueError as error:
        raise bad_request(str(error), param) from error


def chat_options(**fields: Any) -> ChatOptions:
    """:class:`ChatOptions` from request fields; its refusals are 400s."""
    try:
        return ChatOptions(**fields)
    except ValueError as error:
        param = "chat_template_kwargs" if "chat_template_kwargs" in str(error) else None
        raise bad_request(str(error), param) from error


def _with_template(options: ChatOptions, template: str) -> ChatOptions:
    return replace(options, chat_template=template)


@dataclass(slots=True)
class _Reply:
    """What the answer carries besides the engine's deltas."""

    request_id: str
    model: str
    role: str
    echo: str  # text put before the answer ("" unless echo is set)
    prompt_token_ids: list[int] | None  # when return_token_ids is set
    prompt_text: str | None  # when return_prompt_text is set
    return_token_ids: bool
    num_prompt_tokens: int
    n: int = 1
    top_logprobs: int | None = None  # with logprobs: how many alternatives per token
    as_token_ids: bool = False  # return_tokens_as_token_ids: logprob tokens as "token_id:<id>"
    decode: Callable[[int], str] = str
    raw_bytes: TokenBytes | None = None  # a token's own bytes, for logprobs' bytes
    tools: Sequence[FunctionTool] = ()
    tool_choice: ToolChoice = ToolChoice("none")
    parallel_tool_calls: bool = True

    def streamer(self) -> ToolCallStreamer:
        return ToolCallStreamer(self.tools, self.tool_choice, self.parallel_tool_calls)

    @property
    def per_token_fields(self) -> bool:
        """Whether every token's chunk carries something (its logprobs or id) even when
        it adds no text."""
        return self.top_logprobs is not None or self.return_token_ids

    def logprobs(
        self, token_ids: Sequence[int], logprobs: SampleLogprobs | None
    ) -> ChatChoiceLogprobs | None:
        if self.top_logprobs is None:
            return None
        return ChatChoiceLogprobs(
            content=chat_logprobs(
                token_ids, logprobs or [], self.top_logprobs, self.decode, self.as_token_ids,
                self.raw_bytes,
            )
        )


def _reply(
    request: ChatCompletionRequest,
    request_id: str,
    model: str,
    rendered: RenderedChat,
    token_ids: list[int],
    n: int,
    tools: Sequence[FunctionTool],
    tool_choice: ToolChoice,
    response_role: str,
) -> _Reply:
    last = rendered.conversation[-1]
    # vLLM's --response-role names the answer when a generation prompt is added
    role = response_role if request.add_generation_prompt else str(last["role"])
    echo = str(last.get("content") or "") if request.echo and last["role"] == role else ""
    return _Reply(
        request_id=request_id,
        model=model,
        role=role,
        echo=echo,
        prompt_token_ids=token_ids if request.return_token_ids else None,
        prompt_text=rendered.prompt if request.return_prompt_text else None,
        return_token_ids=bool(request.return_token_ids),
        num_prompt_tokens=len(token_ids),
        n=n,
        top_logprobs=(request.top_logprobs or 0) if request.logprobs else None,
        as_token_ids=bool(request.return_tokens_as_token_ids),
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=request.parallel_tool_calls is not False,
    )


async def _complete(reply: _Reply, stream: RequestStream) -> Response:
    try:
        result = await collect(stream, reply.n)
    except (EngineDeadError, StreamDroppedError) as error:
        raise engine_failure(error) from error
    choices = []
    for completion in result.completions:
        answer = parse_answer(
            completion.text, reply.tools, reply.tool_choice, reply.parallel_tool_calls
        )
        content = answer.content
        if reply.echo:
            content = reply.echo + (content or "")
        choices.append(
            ChatChoice(
                index=completion.index,
                message=ChatResponseMessage(
                    role=reply.role,
                    content=content,
                    tool_calls=[call.as_openai() for call in answer.calls],
                ),
                logprobs=reply.logprobs(completion.token_ids, completion.logprobs),
                finish_reason=_finish_reason(
                    completion.finish_reason, bool(answer.calls), reply.tool_choice
                ),
                stop_reason=completion.stop_reason,
                token_ids=completion.token_ids if reply.return_token_ids else None,
            )
        )
    return json_response(
        ChatCompletionResponse(
            id=reply.request_id,
            model=reply.model,
            choices=choices,
            usage=UsageInfo.of(
                result.num_prompt_tokens, result.num_output_tokens, result.num_cached_tokens
            ),
            prompt_logprobs=prompt_logprobs_body(result.prompt_logprobs),
            prompt_token_ids=reply.prompt_token_ids,
            prompt_text=reply.prompt_text,
        )
    )


def _chunk_choice(index: int, content: str, calls: list[dict[str, Any]]) -> ChatChunkChoice:
    return ChatChunkChoice(
        index=index,
        delta=ChatDelta(content=content if content or not calls else None, tool_calls=calls),
    )


def _finish_reason(reason: str | None, has_calls: bool, tool_choice: ToolChoice) -> str | None:
    """OpenAI's ``tool_calls`` when an answer that ended normally holds tool calls, except
    for a named ``tool_choice``: OpenAI (and vLLM since its PR 25054) says ``stop`` there."""
    if has_calls and reason == "stop" and tool_choice.mode != "named":
        return "tool_calls"
    return reason


async def _stream(
    reply: _Reply, stream: RequestStream, include_usage: bool, continuous_usage: bool
) -> AsyncIterator[str]:
    created = int(time.time())
    completion_tokens = [0] * reply.n
    cached_tokens = 0
    ended: set[int] = set()

    def usage(index: int | None = None) -> UsageInfo:
        """The totals, or (continuous usage, vLLM's) the prompt and choice ``index``'s."""
        tokens = sum(completion_tokens) if index is None else completion_tokens[index]
        return UsageInfo.of(reply.num_prompt_tokens, tokens, cached_tokens)

    def chunk(choices: list[ChatChunkChoice], first: bool = False) -> str:
        (choice,) = choices
        return sse(
            ChatCompletionChunk(
                id=reply.request_id,
                created=created,
                model=reply.model,
                choices=choices,
                usage=usage(choice.index) if continuous_usage else None,
                prompt_token_ids=reply.prompt_token_ids if first else None,
                prompt_text=reply.prompt_text if first else None,
            )
        )

    try:
        # OpenAI's first chunk of each choice carries the role and no text; echoed text
        # comes next.
        for index in range(reply.n):
            role = ChatDelta(role=reply.role, content="")
            yield chunk([ChatChunkChoice(index=index, delta=role)], first=index == 0)
            if reply.echo:
                yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(content=reply.echo))])
        streamers = [reply.streamer() for _ in range(reply.n)]
        async for delta in stream:
            index = delta.index
            completion_tokens[index] = delta.num_output_tokens
            cached_tokens = delta.num_cached_tokens
            if index in ended and not delta.text and not delta.token_ids:
                continue  # nothing new for a choice whose end went out already
            tool_stream = streamers[index]
            content, calls = tool_stream.feed(delta.text)
            if delta.finish_reason is not None:
                ended.add(index)
                rest, more = tool_stream.finish()
                if rest or more:  # the held-back text or calls, before the finish
                    if content or calls:
                        yield chunk([_chunk_choice(index, content, calls)])
                    content, calls = rest, more
            finish_reason = (
                _finish_reason(delta.finish_reason, tool_stream.has_calls, reply.tool_choice)
                if delta.finish_reason is not None
                else None
            )
            if not (content or calls or finish_reason or reply.per_token_fields):
                continue  # text held back (a tool call's), or none yet: no empty chunk
            yield chunk(
                [
                    ChatChunkChoice(
                        index=index,
                        delta=ChatDelta(
                            content=content if content or not calls else None, tool_calls=calls
                        ),
                        logprobs=reply.logprobs(delta.token_ids, delta.logprobs),
                        finish_reason=finish_reason,
                        stop_reason=delta.stop_reason if delta.finish_reason else None,
                        token_ids=list(delta.token_ids) if reply.return_token_ids else None,
                    )
                ]
            )
        if include_usage:
            yield sse(
                ChatCompletionChunk(
                    id=reply.request_id,
                    created=created,
                    model=reply.model,
                    choices=[],
                    usage=usage(),
                )
            )
    except (EngineDeadError, StreamDroppedError) as error:
        yield stream_error_event(error)
    finally:
        stream.close()
    yield SSE_DONE
