"""The FastAPI app and its uvicorn lifecycle.

Routes::

    POST /v1/completions  POST /v1/chat/completions  POST /v1/responses  GET /v1/models
                                                                  (API key, when set)
    GET /health  GET|POST /ping  GET /metrics  GET /version  POST /tokenize  POST /detokenize
    POST /reset_prefix_cache

The app's lifespan starts the engine thread on uvicorn's event loop and stops it last.
Graceful shutdown (SIGTERM or SIGINT): uvicorn stops accepting and waits for the open
responses; requests still running after the grace period are aborted in the engine, so
their clients get a clean end (``finish_reason: "abort"``) rather than a cut connection;
then the engine thread stops and the process exits 0.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse

from inflight.engine.async_engine import AsyncLLMEngine
from inflight.engine.protocol import MetricsExporter, ReplicatedEngineClient
from inflight.entrypoints.openai.errors import (
    INVALID_REQUEST,
    SERVER_ERROR,
    OpenAIError,
    bad_request,
    install_error_handlers,
)
from inflight.entrypoints.openai.frontend import install_frontend
from inflight.entrypoints.openai.openapi import install_request_schemas, request_body
from inflight.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from inflight.entrypoints.openai.protocol_responses import (
    ResponsesRequest,
    ResponsesResponse,
)
from inflight.entrypoints.openai.request_fields import (
    TOKENIZE_FIELDS,
    log_unknown_fields,
    refuse_unsupported,
)
from inflight.entrypoints.openai.serving import (
    ServerConfig,
    ServerState,
    json_response,
    off_loop,
    parse_body,
)
from inflight.entrypoints.openai.serving_chat import (
    chat_options,
    create_chat_completion,
    render_messages,
)
from inflight.entrypoints.openai.serving_completions import create_completion
from inflight.entrypoints.openai.serving_responses import create_response
from inflight.entrypoints.openai.tool_calls import parse_tools
from inflight.metrics.prometheus import PrometheusMetrics
from inflight.model.gguf_tokenizer import hf_tokenizer

logger = logging.getLogger(__name__)

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


ServedEngine = AsyncLLMEngine | ReplicatedEngineClient


def build_app(engine: ServedEngine, config: ServerConfig) -> FastAPI:
    """The app serving ``engine``; the engine thread runs while the app's lifespan does."""
    metrics = _server_metrics(engine, config.served_model_names[0])
    state = ServerState(engine=engine, config=config, metrics=metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        logger.info("serving %s as %s", engine.model_path, ", ".join(config.served_model_names))
        try:
            yield
        finally:
            await engine.shutdown()
            logger.info("engine stopped")

    from inflight import __version__

    docs = not config.disable_fastapi_docs  # FastAPI's pages, open as in vLLM
    app = FastAPI(
        title="inflight", version=__version__, lifespan=lifespan,
        docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None,
    )
    # vLLM's --root-path, set as vLLM sets it: requests are served with the prefix (a proxy
    # that keeps it) or without (one that strips it), and /openapi.json names it.
    app.root_path = config.root_path
    app.state.server = state
    install_error_handlers(app)
    install_frontend(app, config.frontend)
    app.include_router(_v1_router(state))
    app.include_router(_service_router(state, engine, __version__))
    install_request_schemas(
        app,
        [
            CompletionRequest,
            ChatCompletionRequest,
            ResponsesRequest,
            TokenizeRequest,
            DetokenizeRequest,
        ],
    )
    return app


def _server_metrics(engine: ServedEngine, model_name: str) -> MetricsExporter:
    if isinstance(engine, AsyncLLMEngine):
        metrics = PrometheusMetrics(lambda: engine.stats, model_name)
        engine.add_observer(metrics)
        return metrics
    return engine.make_metrics(model_name)  # every replica's, labelled by replica


# What /openapi.json publishes for the routes that read their body themselves.
_ERRORS: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorResponse},
    503: {"model": ErrorResponse, "description": "overloaded (max_waiting_requests; with "
          "Retry-After) or the engine is unhealthy"},
    504: {"model": ErrorResponse, "description": "the request passed its request_timeout"},
}
_SSE = {"text/event-stream": {"schema": {"type": "string"}}}


def _v1_router(state: ServerState) -> APIRouter:
    router = APIRouter(
        prefix="/v1",
        dependencies=[Depends(_api_key_check(state.config.api_keys))],
        responses=_ERRORS,
    )

    @router.post(
        "/completions",
        openapi_extra=request_body(CompletionRequest),
        responses={200: {"model": CompletionResponse, "content": _SSE}},
    )
    async def completions(raw: Request) -> Response:
        return await create_completion(state, raw)

    @router.post(
        "/chat/completions",
        openapi_extra=request_body(ChatCompletionRequest),
        responses={200: {"model": ChatCompletionResponse, "content": _SSE}},
    )
    async def chat_completions(raw: Request) -> Response:
        return await create_chat_completion(state, raw)

    @router.post(
        "/responses",
        openapi_extra=request_body(ResponsesRequest),
        responses={200: {"model": ResponsesResponse, "content": _SSE}},
    )
    async def responses(raw: Request) -> Response:
        return await create_response(state, raw)

    @router.get("/models")
    async def models() -> Response:
        return json_response(
            ModelList(data=[_model_card(state, n) for n in state.config.served_model_names])
        )

    @router.get("/models/{name:path}")
    async def model(name: str) -> Response:
        return json_response(_model_card(state, state.resolve_model(name)))

    return router


def _service_router(state: ServerState, engine: ServedEngine, version: str) -> APIRouter:
    router = APIRouter()

    # /ping is vLLM's (SageMaker's) name for the same check, by GET or POST.
    @router.get("/health")
    @router.get("/ping", operation_id="ping_get")  # one id per method: code generators
    @router.post("/ping", operation_id="ping_post")  # choke on a duplicate
    async def health() -> Response:
        if isinstance(engine, AsyncLLMEngine):
            if not engine.is_healthy:
                reason = engine.health_error or "The engine is not running."
                raise OpenAIError(503, reason, SERVER_ERROR)
            return Response(status_code=200)
        # Data-parallel: each replica's state; 503 only when none can answer.
        healthy, body = engine.health_report()
        return JSONResponse(body, status_code=200 if healthy else 503)

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    @router.get("/version")
    async def version_route() -> Response:
        return JSONResponse({"version": version})

    @router.post(
        "/reset_prefix_cache", dependencies=[Depends(_api_key_check(state.config.api_keys))]
    )
    async def reset_prefix_cache() -> Response:
        # vLLM's route; refused (409) while requests hold blocks, as LLM.reset_prefix_cache.
        if not await state.engine.reset_prefix_cache():
            raise OpenAIError(
                409,
                "The prefix cache cannot be reset while requests hold KV blocks; retry when idle.",
                "invalid_request_error",
            )
        return Response(status_code=200)

    @router.post(
        "/tokenize",
        openapi_extra=request_body(TokenizeRequest),
        responses={200: {"model": TokenizeResponse}, **_ERRORS},
    )
    async def tokenize(raw: Request) -> Response:
        request = await parse_body(raw, TokenizeRequest)
        return json_response(await off_loop(tokenize_request, state, request))

    @router.post(
        "/detokenize",
        openapi_extra=request_body(DetokenizeRequest),
        responses={200: {"model": DetokenizeResponse}, **_ERRORS},
    )
    async def detokenize(raw: Request) -> Response:
        request = await parse_body(raw, DetokenizeRequest)
        state.resolve_model(request.model)
        log_unknown_fields(request, "/detokenize")
        return json_response(await off_loop(detokenize_request, state, request))

    return router


def detokenize_request(state: ServerState, request: DetokenizeRequest) -> DetokenizeResponse:
    """vLLM's /detokenize; ids outside the vocabulary are a 400 (runs off the loop)."""
    vocab_size = state.engine.vocab_size
    bad = [t for t in request.tokens if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(
            f"Token id(s) {bad[:5]} are outside the vocabulary (size {vocab_size}).",
            "tokens",
        )
    return DetokenizeResponse(prompt=state.engine.tokenizer.decode(request.tokens))


def tokenize_request(state: ServerState, request: TokenizeRequest) -> TokenizeResponse:
    """vLLM's /tokenize: a prompt, or messages rendered as the chat endpoint renders them
    (runs off the event loop: its cost grows with the input)."""
    state.resolve_model(request.model)
    log_unknown_fields(request, "/tokenize")
    refuse_unsupported(request, TOKENIZE_FIELDS)
    tokenizer = state.engine.tokenizer
    if (request.prompt is None) == (request.messages is None):
        raise bad_request("Pass exactly one of 'prompt' and 'messages'.", "prompt")
    if request.messages is None:
        _refuse_messages_only_fields(request)
    if request.messages is not None:
        options = chat_options(
            chat_template=request.chat_template,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            add_special_tokens=bool(request.add_special_tokens),
            chat_template_kwargs=request.chat_template_kwargs,
            documents=request.documents,
        )
        tools = parse_tools(request.tools)  # rendered as the chat endpoint renders them
        tokens = render_messages(state, request.messages, options, tools).prompt_token_ids
    else:
        add_special = True if request.add_special_tokens is None else request.add_special_tokens
        tokens = list(tokenizer.encode(request.prompt, add_special_tokens=add_special))
    token_strs = None
    if request.return_token_strs:
        token_strs = [str(t) for t in tokenizer.convert_ids_to_tokens(tokens)]
    return TokenizeResponse(
        count=len(tokens),
        max_model_len=state.engine.max_model_len,
        tokens=tokens,
        token_strs=token_strs,
    )


# /tokenize fields that only shape how chat messages render: with a prompt they would do
# nothing (vLLM ignores them there), so they are refused rather than ignored.
_MESSAGES_ONLY = (
    "tools", "chat_template", "chat_template_kwargs", "documents", "add_generation_prompt",
    "continue_final_message",
)


def _refuse_messages_only_fields(request: TokenizeRequest) -> None:
    """A 400 naming a chat-only field that a ``prompt`` request sets to a non-default."""
    for name in _MESSAGES_ONLY:
        value = getattr(request, name)
        if name in request.model_fields_set and value != TokenizeRequest.model_fields[name].default:
            raise bad_request(
                f"'{name}' applies to chat 'messages' only; it does nothing to a 'prompt'.", name
            )


def _model_card(state: ServerState, name: str) -> ModelCard:
    return ModelCard(
        id=name, root=state.engine.model_path, max_model_len=state.engine.max_model_len
    )


def _api_key_check(api_keys: tuple[str, ...]) -> Any:
    """A dependency requiring ``Authorization: Bearer <key>``, the key any of ``api_keys``,
    when there are any (vLLM's ``--api-key k1 k2``)."""

    async def check(raw: Request) -> None:
        if not api_keys:
            return
        header = raw.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if not header:
            raise OpenAIError(
                401,
                "You didn't provide an API key. Pass it as 'Authorization: Bearer KEY'.",
                INVALID_REQUEST,
                code="invalid_api_key",
            )
        if scheme.lower() != "bearer" or not _is_one_of(token.strip(), api_keys):
            raise OpenAIError(
                401, "Incorrect API key provided.", INVALID_REQUEST, code="invalid_api_key"
            )

    return check


def _is_one_of(token: str, keys: tuple[str, ...]) -> bool:
    """Whether ``token`` is one of ``keys``. Each comparison takes constant time, and every
    key is compared, so timing leaks neither how much of a guess was right nor which key
    it came close to."""
    given = token.encode()
    matches = [hmac.compare_digest(given, key.encode()) for key in keys]
    return any(matches)


# ---------------------------------------------------------------------- running it


class GracefulServer(uvicorn.Server):
    """uvicorn, plus: abort the engine's requests once the shutdown grace period is over."""

    def __init__(self, config: uvicorn.Config, engine: ServedEngine, grace_s: float) -> None:
        super().__init__(config)
        self._engine = engine
        self._grace_s = grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        logger.info("shutting down: waiting up to %.0f s for requests in flight", self._grace_s)
        timer = asyncio.get_running_loop().call_later(self._grace_s, self._engine.abort_all)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def run_server(
    engine: ServedEngine,
    config: ServerConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    shutdown_timeout: float = 30.0,
    log_level: str = "info",
    access_log: bool = True,
) -> int:
    """Serve until SIGTERM/SIGINT; returns 0 after a graceful shutdown."""
    # Chat templates and /tokenize need the transformers tokenizer: build it before
    # /health says ready rather than in the first chat request (~1 s on a slow CPU).
    hf_tokenizer(engine.tokenizer)
    app = build_app(engine, config)
    uv_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        lifespan="on",
        # Backstop only: our abort at ``shutdown_timeout`` normally ends every response.
        timeout_graceful_shutdown=int(shutdown_timeout) + 10,
        **dict(config.frontend.uvicorn),  # TLS, a Unix socket, the h11 limit
    )
    server = GracefulServer(uv_config, engine, shutdown_timeout)
    # After its graceful shutdown uvicorn re-raises the signal it caught, through the
    # handler that was installed before it started. Ours is a no-op, so a SIGTERM or
    # Ctrl-C that ended a clean shutdown does not turn into a non-zero exit.
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, _after_shutdown) for sig in handled}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        return 1
    return 0


def _after_shutdown(signum: int, frame: FrameType | None) -> None:
    del signum, frame  # uvicorn has already shut down; nothing left to do
