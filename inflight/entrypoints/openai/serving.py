"""What every generation route shares: server state, body parsing, adding requests to the
engine, server-sent events, merging several requests' streams, and client disconnects.

Disconnects: from the moment its body is read, a request's handling (tokenising, adding
to the engine, and for a non-streaming request the whole generation) is raced against the
connection (:func:`until_disconnect`), so a client that gives up while its request waits
has it aborted before it is computed. A streaming response is then cancelled by
Starlette when the client goes away, and :class:`EngineStreamingResponse` closes its
streams however it ends. Closing a stream aborts the engine request and frees its KV
blocks before the engine's next step.

The event loop never blocks on big inputs: parsing a large body, tokenising, rendering
chat templates and detokenising run on :data:`TOKENIZER_EXECUTOR` (:func:`off_loop`), so
``/health``, ``/metrics`` and other streams keep answering while they run.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope, Send

from inflight.engine.async_engine import RequestTimeoutError
from inflight.engine.llm_engine import EngineOverloadedError
from inflight.engine.protocol import EngineClient, MetricsExporter
from inflight.engine.request_stream import (
    EngineDeadError,
    EngineShutdownError,
    EngineUnavailableError,
    RequestDelta,
    RequestFailedError,
    RequestStream,
    StreamDroppedError,
)
from inflight.entrypoints.openai.errors import (
    INVALID_REQUEST,
    SERVER_ERROR,
    OpenAIError,
    StepRefusedError,
    bad_request,
    from_engine_error,
    from_validation_error,
    overloaded,
    request_timeout,
)
from inflight.entrypoints.openai.frontend import FrontendConfig
from inflight.outputs import PromptLogprobs, SampleLogprobs
from inflight.sampling_params import CONSTRAINT_FAILED, NO_TOKEN_LEFT, SamplingParams

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
P = ParamSpec("P")

# One worker, as vLLM's tokenizer executor: big inputs queue behind each other instead of
# several threads competing with the event loop for the GIL (and for two cores).
TOKENIZER_EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inflight-tokenizer")
# Bodies above this are parsed off the loop; below it a thread hop costs more than parsing.
OFF_LOOP_BODY_BYTES = 64 * 1024
# Deltas buffered between several prompts' streams and their one SSE response. Bounded,
# so a response that cannot send leaves the deltas in the streams, whose limits drop it.
MERGED_QUEUE_SIZE = 256


async def off_loop(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)`` on :data:`TOKENIZER_EXECUTOR`; its exceptions propagate.

    For work whose cost grows with the input (tokenising, chat templates, detokenising).
    Cancelling the caller abandons the result; the call itself runs to its end."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(TOKENIZER_EXECUTOR, functools.partial(fn, *args, **kwargs))


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The server's own options (the engine's live in the engine)."""

    served_model_names: tuple[str, ...]
    api_keys: tuple[str, ...] = ()  # any of them opens the /v1 routes; none: no key needed
    chat_template: str | None = None  # overrides the tokenizer's template when set
    chat_template_content_format: str = "auto"  # chat_utils.CONTENT_FORMATS
    # vLLM's --trust-request-chat-template: a template sent in a request runs arbitrary
    # Jinja (a loop of 10^10 steps holds the tokenizer thread, and every request, for
    # good), so requests may carry one only when the operator says so.
    trust_request_chat_template: bool = False
    tool_call_parser: str = "hermes"  # the one parser (tool_calls.TOOL_CALL_PARSERS)
    response_role: str = "assistant"  # a chat answer's role when a generation prompt is added
    enable_log_requests: bool = False  # one INFO line per request (ServerState.log_request)
    disable_fastapi_docs: bool = False  # vLLM's: no /docs or /redoc pages
    root_path: str = ""  # the prefix a proxy serves the app under (FastAPI's root_path)
    frontend: FrontendConfig = field(default_factory=FrontendConfig)  # vLLM's HTTP flags


@dataclass(frozen=True, slots=True)
class ServerState:
    engine: EngineClient
    config: ServerConfig
    metrics: MetricsExporter

    @property
    def model_name(self) -> str:
        return self.config.served_model_names[0]

    def resolve_model(self, name: str | None) -> str:
        """The served name a request asked for (the first one if it named none), or 404."""
        if not name:  # null or "" (as in vLLM): the served model
            return self.model_name
        if name not in self.config.served_model_names:
            raise OpenAIError(
                404,
                f"The model `{name}` does not exist.",
                param="model",
                code="model_not_found",
            )
        return name

    def log_request(
        self, request_id: str, prompts: Sequence[tuple[str | None, list[int]]],
        params: SamplingParams,
    ) -> None:
        """vLLM's ``--enable-log-requests``: one INFO line per request (not its text)."""
        if self.config.enable_log_requests:
            prompt_tokens = [len(token_ids) for _, token_ids in prompts]
            logger.info(
                "Received request %s: prompt tokens: %s, params: %s",
                request_id, prompt_tokens[0] if len(prompt_tokens) == 1 else prompt_tokens,
                params,
            )


async def parse_body(raw: Request, model: type[M]) -> M:
    body = await raw.body()
    try:
        if len(body) > OFF_LOOP_BODY_BYTES:
            return await off_loop(model.model_validate_json, body)
        return model.model_validate_json(body)
    except ValidationError as error:
        raise from_validation_error(error) from None


def json_response(body: BaseModel) -> Response:
    return Response(body.model_dump_json(), media_type="application/json")


def engine_failure(error: Exception) -> OpenAIError:
    """An engine-side failure while a request was running is a 500, ours not the client's
    (except a request whose own parameters left no token to sample: a 400);
    a request that passed its deadline is a 504; a dead data-parallel replica is a 503
    (the service is still up: retry). A dropped stream of a request the server itself reads
    (not streamed) means the server fell behind: a 503, retry."""
    if isinstance(error, StreamDroppedError):
        return OpenAIError(
            503, f"The server fell behind reading this request's output: {error}", SERVER_ERROR
        )
    if isinstance(error, StepRefusedError):
        return error.openai_error
    if isinstance(error, RequestTimeoutError):
        return request_timeout(f"The request timed out: {error}")
    if isinstance(error, RequestFailedError) and NO_TOKEN_LEFT in str(error):
        return bad_request(f"The request's sampling parameters leave nothing to sample: {error}")
    if isinstance(error, RequestFailedError) and CONSTRAINT_FAILED in str(error):
        return bad_request(f"The request's constraint cannot be followed: {error}",
                           "structured_outputs")
    status = 503 if isinstance(error, EngineUnavailableError) else 500
    return OpenAIError(status, f"The engine failed while serving this request: {error}", SERVER_ERROR)


async def add_requests(
    engine: EngineClient,
    base_id: str,
    prompts: Sequence[tuple[str | None, list[int]]],
    params: SamplingParams,
    priority: int,
    arrival_time: float,
    cache_salt: str | None = None,
    logprobs_param: str = "logprobs",
    request_timeout: float | None = None,
) -> list[RequestStream]:
    """Add one engine request per prompt; all or none are kept.

    Every prompt is queued before any acceptance is awaited, so the engine takes a
    request's prompts in one step, as it takes concurrent requests (one at a time, a
    batch of N prompts took N steps to admit, and the first prompts' output piled up
    unread meanwhile).

    Engine ids are ``base_id-i-<random>``: ``base_id`` may come from the client (vLLM's
    ``request_id``), so it alone need not be unique. An engine refusal of the logprobs
    count names ``logprobs_param`` (chat calls it ``top_logprobs``).
    """
    suffix = uuid.uuid4().hex[:8]
    adds = [
        asyncio.ensure_future(
            engine.add_request(
                f"{base_id}-{index}-{suffix}",
                {"prompt": text, "prompt_token_ids": token_ids, "cache_salt": cache_salt},
                params,
                priority=priority,
                arrival_time=arrival_time,
                request_timeout=request_timeout,
            )
        )
        for index, (text, token_ids) in enumerate(prompts)
    ]
    # Cancelling this gather cancels every add, and a cancelled add aborts its request.
    results = await asyncio.gather(*adds, return_exceptions=True)
    streams = [r for r in results if isinstance(r, RequestStream)]
    error = next((r for r in results if isinstance(r, BaseException)), None)
    if error is None:
        return streams
    for stream in streams:
        stream.close()
    if isinstance(error, EngineShutdownError):
        raise OpenAIError(503, "The server is shutting down.", SERVER_ERROR) from error
    if isinstance(error, EngineOverloadedError):
        raise overloaded(f"The server is overloaded: {error}") from error
    if isinstance(error, EngineDeadError):
        raise OpenAIError(503, str(error), SERVER_ERROR) from error
    if isinstance(error, (ValueError, TypeError)):
        openai_error = from_engine_error(error)
        if openai_error.param == "logprobs":
            openai_error.param = logprobs_param
        raise openai_error from error
    raise error


async def collect_all(streams: Sequence[RequestStream], n: int) -> list[Collected]:
    """:func:`collect` of every stream at once (one request's prompts); if one fails, the
    others are cancelled and aborted too, not left generating for nobody."""
    tasks = [asyncio.ensure_future(collect(stream, n)) for stream in streams]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


@dataclass(slots=True)
class Completion:
    """One completion (``index``) of a request, gathered from its deltas."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta: RequestDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(delta.logprobs)
        self.cumulative_logprob = delta.cumulative_logprob
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


@dataclass(slots=True)
class Collected:
    """A whole request: its n completions by index, and what the prompt reported."""

    completions: list[Completion]
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def num_output_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)


async def collect(stream: RequestStream, n: int = 1) -> Collected:
    """All of a request's ``n`` completions; aborts the request if cancelled."""
    result = Collected([Completion(i) for i in range(n)])
    last: RequestDelta | None = None
    try:
        async for delta in stream:
            result.completions[delta.index].add(delta)
            if delta.prompt_logprobs is not None:
                result.prompt_logprobs = delta.prompt_logprobs
            last = delta
    finally:
        stream.close()
    assert last is not None and last.finished
    result.num_prompt_tokens = last.num_prompt_tokens
    result.num_cached_tokens = last.num_cached_tokens
    for completion in result.completions:  # the request's end ends every completion
        if completion.finish_reason is None:
            completion.finish_reason = last.finish_reason
    return result


async def merge_streams(
    streams: Sequence[RequestStream],
) -> AsyncIterator[tuple[int, RequestDelta]]:
    """Deltas of several requests as they come, tagged with the request's index."""
    if len(streams) == 1:  # the common case needs no tasks
        async for delta in streams[0]:
            yield 0, delta
        return
    merged: asyncio.Queue[tuple[int, RequestDelta | BaseException | None]] = asyncio.Queue(
        MERGED_QUEUE_SIZE
    )

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for delta in stream:
                await merged.put((index, delta))
        except Exception as error:
            await merged.put((index, error))
        await merged.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await merged.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


def sse(body: BaseModel | dict[str, Any]) -> str:
    payload = body.model_dump_json() if isinstance(body, BaseModel) else _dumps(body)
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EngineStreamingResponse(StreamingResponse):
    """Server-sent events from engine streams, closed (their requests aborted if still
    running) however the response ends: its end, a disconnect, a cancellation, an error,
    or a disconnect noticed before the event generator ever started (whose ``finally``
    would then never run)."""

    def __init__(self, events: AsyncIterable[str], streams: Sequence[RequestStream]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self._streams = list(streams)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self._streams:
                stream.close()


def stream_failure(error: EngineDeadError | StreamDroppedError) -> OpenAIError:
    """Why a stream whose status line went out long ago ends early: the engine failed, or
    the client read too slowly (its stream was dropped)."""
    if isinstance(error, StreamDroppedError):
        return OpenAIError(408, str(error), INVALID_REQUEST, code="stream_dropped")
    return engine_failure(error)


def stream_error_event(error: EngineDeadError | StreamDroppedError) -> str:
    """The in-band error event that ends such a stream (completions and chat)."""
    return sse(stream_failure(error).body())


def _dumps(body: dict[str, Any]) -> str:
    return json.dumps(body, separators=(",", ":"))


async def until_disconnect(raw: Request, work: Coroutine[Any, Any, Response]) -> Response:
    """Run ``work``, cancelling it (which aborts its requests) if the client disconnects."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    # Nobody is listening; the status only shows up in the access log.
    return Response(status_code=499)


async def _wait_for_disconnect(raw: Request) -> None:
    # The body has been read already, so the next message can only be the disconnect.
    while (await raw.receive())["type"] != "http.disconnect":
        pass
