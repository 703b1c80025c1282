"""``inflight serve [MODEL]``: the OpenAI-compatible HTTP server (FastAPI on uvicorn).

The model is loaded before the port opens, so ``GET /health`` answering 200 means ready.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inflight.entrypoints.openai.api_server import ServedEngine
    from inflight.entrypoints.openai.serving import ServerConfig

logger = logging.getLogger(__name__)

DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"
UVICORN_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]
# A --chat-template value with one of these is a template, not a path (vLLM's rule).
JINJA_CHARS = "{}\n"


def register(subparsers: argparse._SubParsersAction) -> None:
    from inflight.bench.cli_types import port, seconds
    from inflight.entrypoints.chat_utils import CONTENT_FORMATS
    from inflight.entrypoints.engine_args import add_engine_args, add_vllm_only_args
    from inflight.entrypoints.openai.frontend import add_frontend_args

    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL over /v1/completions, /v1/chat/completions, /v1/responses, "
        "/v1/models, /health, /metrics (Prometheus), /tokenize, /detokenize and /version.",
    )
    add_engine_args(parser, model_positional=True)
    group = parser.add_argument_group("server")
    group.add_argument("--host", type=_host, default="127.0.0.1")
    group.add_argument("--port", type=port, default=8000, help="0-65535; 0 picks a free one")
    group.add_argument(
        "--api-key",
        nargs="+",
        default=None,
        help="require 'Authorization: Bearer KEY' on every /v1 route, KEY any of these "
        "keys (default: $INFLIGHT_API_KEY, else vLLM's $VLLM_API_KEY, one key; else no "
        "key)",
    )
    group.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use in 'model' (default: the model argument exactly as "
        f"given, as in vLLM: /models/foo is served as /models/foo; {DEFAULT_SERVED_MODEL_NAME} "
        "without one)",
    )
    group.add_argument(
        "--chat-template",
        default=None,
        help="a file holding a Jinja chat template, or the template itself (a value with "
        "'{', '}' or a newline that names no file, used as written, as in vLLM), "
        "overriding the tokenizer's",
    )
    group.add_argument(
        "--response-role",
        default="assistant",
        help="the role chat answers carry (message.role, the first stream chunk's "
        "delta.role) when the request adds a generation prompt, as in vLLM",
    )
    group.add_argument(
        "--chat-template-content-format",
        default="auto",
        choices=list(CONTENT_FORMATS),
        help="what the template sees as a message's content: string (text parts joined "
        "with newlines), openai (a list of {type: text, text} parts), or auto: openai for "
        "a template that loops over content, else string",
    )
    group.add_argument(
        "--tool-call-parser",
        default="hermes",
        choices=["hermes"],
        help="how answers to tool_choice 'auto' are parsed: hermes reads "
        "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> blocks",
    )
    group.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help="accepted, with no change in behaviour, for vLLM's tool-calling commands: "
        "tool_choice 'auto' always works here, parsed by --tool-call-parser",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=seconds(allow_zero=True),
        default=30.0,
        help="seconds requests in flight may take to finish after SIGTERM/"
        "SIGINT before they are aborted",
    )
    dp = parser.add_argument_group("data parallel (vLLM's names)")
    dp.add_argument(
        "--data-parallel-size", "-dp", type=int, default=1,
        help="engine replicas behind the one endpoint (> 1 needs --data-parallel-backend ray)",
    )
    dp.add_argument(
        "--data-parallel-backend", "-dpb", default=None, choices=["ray"],
        help="ray: one replica per Ray actor, routed by least outstanding tokens with "
        "prefix-cache affinity (needs pip install 'inflight[ray]')",
    )
    dp.add_argument(
        "--data-parallel-address", "-dpa", default=None,
        help="the Ray cluster to join (ray.init address, e.g. auto); default: start a "
        "local one on loopback",
    )
    group.add_argument(
        "--trust-request-chat-template", action="store_true",
        help="let requests carry their own 'chat_template' (arbitrary Jinja, run on the "
        "server's one tokenizer thread); refused with a 400 otherwise, as in vLLM",
    )
    group.add_argument(
        "--request-timeout",
        type=seconds(),
        default=None,
        help="seconds a request may take from arrival to its end; past it the request "
        "is aborted and answered 504 (a stream ends with an error event). A request's "
        "own 'request_timeout' field overrides it (default: no limit)",
    )
    group.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    group.add_argument(
        "--uvicorn-log-level", default=None, choices=UVICORN_LOG_LEVELS,
        help="uvicorn's own log level (default: --log-level)",
    )
    group.add_argument(
        "--disable-fastapi-docs", action="store_true",
        help="serve no Swagger UI (/docs) or ReDoc (/redoc) pages (vLLM's flag; "
        "/openapi.json stays)",
    )
    group.add_argument(
        "--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
        help="log one line per request at INFO: its id, prompt tokens and sampling "
        "parameters (off by default, as in vLLM)",
    )
    group.add_argument(
        "--disable-log-requests", action=argparse.BooleanOptionalAction, default=None,
        help="deprecated in vLLM; accepted with no effect (requests are logged only with "
        "--enable-log-requests)",
    )
    group.add_argument("--disable-uvicorn-access-log", action="store_true")
    group.add_argument(
        "--root-path", default=None,
        help="the path prefix a proxy serves this server under (FastAPI's root_path, as "
        "in vLLM): routes answer with and without it, and /openapi.json names it",
    )
    group.add_argument(
        "--no-warmup", action="store_true",
        help="skip the start-up dummy request that pays the first forward passes' one-off "
        "costs before the server reports ready",
    )
    group.add_argument(
        "--config", default=None, metavar="FILE",
        help="a YAML file of options, its keys the long option names (port: 8001, "
        "enable-prefix-caching: true, model: path); the command line wins over it, as in vLLM",
    )
    add_frontend_args(parser)
    add_vllm_only_args(parser)
    parser.set_defaults(handler=run)


def default_served_model_name(model: str | None) -> str:
    """vLLM's default: the model argument exactly as given (a path stays a path)."""
    return DEFAULT_SERVED_MODEL_NAME if model is None else model


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template`` as vLLM reads it: the contents of the file it names; else, if
    it holds a Jinja character ('{', '}' or a newline), the template itself, as written
    (vLLM decodes no escapes either: a backslash-n outside a Jinja string stays two
    characters; inside one, Jinja reads it as a newline); else a path that cannot be read."""
    if value is None:
        return None
    try:
        return Path(value).read_text()
    except (OSError, ValueError) as error:
        if not any(char in value for char in JINJA_CHARS):
            raise ValueError(
                f"--chat-template {value!r} looks like a file path, but it cannot be read: "
                f"{error}"
            ) from error
        return value


def _host(text: str) -> str:
    """A host name or address to bind, checked before the model loads (uvicorn's own
    error came only after it)."""
    import socket

    if not text:
        return text  # uvicorn's "every interface"
    try:
        socket.getaddrinfo(text, None)
    except (socket.gaierror, UnicodeError) as error:
        raise argparse.ArgumentTypeError(f"cannot resolve {text!r} to an address: {error}") from None
    return text


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """The keys a client may present: ``--api-key``'s, else ``$INFLIGHT_API_KEY``, else
    ``$VLLM_API_KEY`` (vLLM's, so a server a vLLM user meant to protect is protected)."""
    keys = args.api_key or [
        os.environ.get("INFLIGHT_API_KEY") or os.environ.get("VLLM_API_KEY") or ""
    ]
    return tuple(key for key in keys if key)


def data_parallel(args: argparse.Namespace) -> bool:
    """Whether to serve through Ray replicas; ValueError for a size without a backend."""
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.data_parallel_size > 1 and args.data_parallel_backend is None:
        raise ValueError("--data-parallel-size > 1 needs --data-parallel-backend ray")
    return args.data_parallel_backend == "ray"


def run(args: argparse.Namespace) -> int:
    import importlib.util

    from inflight.entrypoints.engine_args import engine_options
    from inflight.entrypoints.openai.api_server import run_server

    use_ray = data_parallel(args)
    options = engine_options(args)  # refuses a vLLM flag's value before anything loads
    if use_ray and importlib.util.find_spec("ray") is None:
        from inflight.distributed.client import RAY_MISSING

        print(f"inflight: error: {RAY_MISSING}", file=sys.stderr)
        return 2

    logging.basicConfig(
        level=args.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s"
    )
    if args.disable_log_requests is not None:
        logger.warning("--disable-log-requests is deprecated (as in vLLM) and has no effect: "
                       "requests are logged only with --enable-log-requests")
    config = server_config(args)
    return run_server(
        start_engine(args, options, use_ray),
        config,
        host=args.host,
        port=args.port,
        shutdown_timeout=args.shutdown_timeout,
        log_level=args.uvicorn_log_level or args.log_level,
        access_log=not args.disable_uvicorn_access_log,
    )


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The server's own options from the command line (``ValueError`` naming a flag)."""
    from inflight.entrypoints.openai.frontend import frontend_config
    from inflight.entrypoints.openai.serving import ServerConfig

    return ServerConfig(
        served_model_names=tuple(args.served_model_name or [default_served_model_name(args.model)]),
        api_keys=api_keys(args),
        chat_template=load_chat_template(args.chat_template),
        chat_template_content_format=args.chat_template_content_format,
        tool_call_parser=args.tool_call_parser,
        trust_request_chat_template=args.trust_request_chat_template,
        response_role=args.response_role,
        enable_log_requests=args.enable_log_requests,
        disable_fastapi_docs=args.disable_fastapi_docs,
        root_path=(args.root_path or "").rstrip("/"),  # "/prefix/" serves "/prefix/v1/..."
        frontend=frontend_config(args),
    )


def start_engine(args: argparse.Namespace, options: dict[str, Any], use_ray: bool) -> ServedEngine:
    """The engine (or Ray replicas) serving ``args.model``, warmed up unless told not to."""
    if use_ray:
        from inflight.distributed.client import DataParallelConfig, DataParallelEngineClient

        dp_config = DataParallelConfig(
            data_parallel_size=args.data_parallel_size, address=args.data_parallel_address
        )
        replica_options = {**options, "request_timeout": args.request_timeout,
                           "warmup": not args.no_warmup}
        return DataParallelEngineClient(args.model, replica_options, dp_config)
    from inflight.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine.from_options(
        args.model, request_timeout=args.request_timeout, **options
    )
    if not args.no_warmup:
        # Before /health says ready, so the first clients do not pay for it (seconds on CPU).
        logger.info("warm-up run took %.1f s", engine.warm_up())
    return engine
