"""``inflight serve [MODEL]``: the OpenAI-compatible HTTP server (FastAPI on uvicorn).

The model is loaded before the port opens, so ``GET /health`` answering 200 means ready.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"


def register(subparsers: argparse._SubParsersAction) -> None:
    from inflight.entrypoints.engine_args import add_engine_args

    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL over /v1/completions, /v1/chat/completions, /v1/models, "
        "/health, /metrics (Prometheus), /tokenize, /detokenize and /version.",
    )
    add_engine_args(parser, model_positional=True)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every /v1 route "
        "(default: $INFLIGHT_API_KEY, else no key)",
    )
    group.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use in 'model' (default: the model path's "
        f"basename, or {DEFAULT_SERVED_MODEL_NAME})",
    )
    group.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template, or a file holding one, overriding the tokenizer's",
    )
    group.add_argument(
        "--tool-call-parser",
        default="hermes",
        choices=["hermes"],
        help="how answers to tool_choice 'auto' are parsed: hermes reads "
        "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> blocks",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds requests in flight may take to finish after SIGTERM/"
        "SIGINT before they are aborted",
    )
    group.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds a request may take from arrival to its end; past it the request "
        "is aborted and answered 504 (a stream ends with an error event). A request's "
        "own 'request_timeout' field overrides it (default: no limit)",
    )
    group.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    group.add_argument("--disable-uvicorn-access-log", action="store_true")
    group.add_argument(
        "--no-warmup", action="store_true",
        help="skip the start-up dummy request that pays the first forward passes' one-off "
        "costs before the server reports ready",
    )
    parser.set_defaults(handler=run)


def default_served_model_name(model: str | None) -> str:
    if model is None:
        return DEFAULT_SERVED_MODEL_NAME
    return Path(model.rstrip("/\\")).name or model


def load_chat_template(value: str | None) -> str | None:
    """A template given inline, or the contents of the file it names."""
    if value is None:
        return None
    if "{" not in value and Path(value).is_file():
        return Path(value).read_text()
    if "{" not in value:
        raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")
    return value


def run(args: argparse.Namespace) -> int:
    from inflight.engine.async_engine import AsyncLLMEngine
    from inflight.entrypoints.engine_args import engine_options
    from inflight.entrypoints.openai.api_server import run_server
    from inflight.entrypoints.openai.serving import ServerConfig

    logging.basicConfig(
        level=args.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s"
    )
    config = ServerConfig(
        served_model_names=tuple(args.served_model_name or [default_served_model_name(args.model)]),
        api_key=args.api_key or os.environ.get("INFLIGHT_API_KEY") or None,
        chat_template=load_chat_template(args.chat_template),
        tool_call_parser=args.tool_call_parser,
    )
    if args.request_timeout is not None and not args.request_timeout > 0:
        raise SystemExit(f"--request-timeout must be > 0 seconds, got {args.request_timeout}")
    engine = AsyncLLMEngine.from_options(
        args.model, request_timeout=args.request_timeout, **engine_options(args)
    )
    if not args.no_warmup:
        # Before /health says ready, so the first clients do not pay for it (seconds on CPU).
        logging.getLogger(__name__).info("warm-up run took %.1f s", engine.warm_up())
    return run_server(
        engine,
        config,
        host=args.host,
        port=args.port,
        shutdown_timeout=args.shutdown_timeout,
        log_level=args.log_level,
        access_log=not args.disable_uvicorn_access_log,
    )
