"""vLLM's HTTP front-end flags for ``inflight serve``: CORS, TLS, a Unix socket, request-id
headers, extra ASGI middleware, forced usage in streams, quieter access logs.

vLLM users start servers with these (``vllm serve --allowed-origins '["*"]' --ssl-keyfile
...``), so each is either implemented as vLLM implements it (vLLM 0.32,
``vllm/entrypoints/launchers/cli_args.py``, ``serve/middleware/register.py``) or accepted
only at a value that changes nothing here and refused by name, with the reason, at any
other (:data:`NEUTRAL_FRONTEND_ARGS`); never silently ignored. Everything is checked before
the model loads: a missing certificate or a middleware that cannot be imported is one line.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import logging
import ssl
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inflight.bench.cli_types import int_at_least
from inflight.entrypoints.engine_args import add_neutral_args, neutral_values
from inflight.vllm_engine_args import IS_BOOL, Accepts, Neutral, equals, optional_str

logger = logging.getLogger(__name__)

_DEST = "vllm_frontend_"


# vLLM's front-end flags that mean nothing here: accepted at these values only.
NEUTRAL_FRONTEND_ARGS: dict[str, Neutral] = {
    "api_server_count": Neutral(
        equals(1), "one API server process serves here (scale out: --data-parallel-backend ray)",
        int, ("-asc",)),
    "headless": Neutral(equals(False), "inflight always serves HTTP"),
    "grpc": Neutral(equals(False), "inflight serves HTTP only"),
    "grpc_port": Neutral(equals(None), "inflight serves HTTP only", optional_str),
    "lora_modules": Neutral(
        equals(None), "LoRA adapters are not supported", optional_str, several=True),
    "tool_parser_plugin": Neutral(equals(""), "the hermes parser is built in; no plugins", str),
    "tool_server": Neutral(equals(None), "built-in tool servers are not supported", optional_str),
    "tokens_only": Neutral(equals(False), "every route serves text as well as tokens"),
    "enable_scale_out": Neutral(equals(False), "scale out with --data-parallel-backend ray"),
    "enable_ssl_refresh": Neutral(
        equals(False), "certificates are read once, at start-up (restart to renew them)"),
    "enable_tokenizer_info_endpoint": Neutral(equals(False), "there is no /tokenizer_info route"),
    "enable_server_load_tracking": Neutral(
        equals(False), "there is no /load route (the load is at /metrics: num_requests_running)"),
    "enable_per_request_metrics": Neutral(equals(False), "per-request figures are at /metrics"),
    "trust_request_mm_kwargs": Neutral(IS_BOOL, "this model reads text only"),
    "enable_prompt_tokens_details": Neutral(
        IS_BOOL, "usage.prompt_tokens_details (cached_tokens) is always filled, as OpenAI's"),
    "enable_log_outputs": Neutral(
        equals(False), "the request log (--enable-log-requests) carries no texts"),
    "enable_log_deltas": Neutral(IS_BOOL, "the request log carries no texts"),
    "max_log_len": Neutral(
        Accepts(lambda value: value is None or value >= 0, "any length"),
        "the request log carries no prompt text to cut", int),
    "log_error_stack": Neutral(IS_BOOL, "an error's stack is logged at DEBUG"),
    "sse_keep_alive_interval": Neutral(
        equals(0), "streams send no keep-alive comments", int),
    "tool_strict_level": Neutral(
        equals("auto"), "a forced call follows its function's schema (a grammar)", str),
    "h11_max_header_count": Neutral(
        equals(256), "uvicorn's h11 protocol has no header-count limit to set", int),
    "enable_offline_docs": Neutral(IS_BOOL, "the /docs pages load FastAPI's assets"),
    "fingerprint_mode": Neutral(equals("full", "none"), "system_fingerprint is left null", str),
}


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    """The front-end flags that act, as read and checked from the command line."""

    allowed_origins: tuple[str, ...] = ()  # CORS: none allowed unless named (vLLM 0.32)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    enable_request_id_headers: bool = False  # X-Request-Id on every response
    middleware: tuple[Any, ...] = ()  # imported classes or coroutine functions
    enable_force_include_usage: bool = False  # every stream ends with a usage chunk
    quiet_endpoints: tuple[str, ...] = ()  # paths left out of uvicorn's access log
    uvicorn: tuple[tuple[str, Any], ...] = ()  # ssl_*, uds, h11 limit: uvicorn.Config's


def add_frontend_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's front-end flags, under vLLM's names (``inflight serve --help`` lists them)."""
    group = parser.add_argument_group("vLLM's HTTP front-end flags")
    group.add_argument(
        "--allowed-origins", type=_json_list, default=[],
        help='CORS: origins allowed to call from a browser, a JSON list such as \'["*"]\' '
        "(default: none, as in vLLM 0.32)")
    group.add_argument("--allowed-methods", type=_json_list, default=["*"],
                       help="CORS: allowed methods, a JSON list (default: all)")
    group.add_argument("--allowed-headers", type=_json_list, default=["*"],
                       help="CORS: allowed request headers, a JSON list (default: all)")
    group.add_argument("--allow-credentials", action=argparse.BooleanOptionalAction,
                       default=False, help="CORS: allow cookies and credentials")
    group.add_argument("--ssl-keyfile", default=None, help="serve HTTPS: the key file")
    group.add_argument("--ssl-certfile", default=None, help="serve HTTPS: the certificate")
    group.add_argument("--ssl-ca-certs", default=None, help="CA certificates for clients")
    group.add_argument(
        "--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE), choices=[0, 1, 2],
        help="client certificates: 0 not asked, 1 optional, 2 required (Python's ssl)")
    group.add_argument("--ssl-ciphers", default=None, help="TLS 1.2 cipher suites")
    group.add_argument("--uds", default=None,
                       help="listen on this Unix domain socket instead of --host/--port")
    group.add_argument(
        "--enable-request-id-headers", action="store_true",
        help="an X-Request-Id header on every response (the request's own, else a new one)")
    group.add_argument(
        "--middleware", action="append", default=[],
        help="an ASGI middleware to add, as an import path (module.name): a class is added "
        "with app.add_middleware, a coroutine function as an 'http' middleware; repeatable")
    group.add_argument(
        "--enable-force-include-usage", action="store_true",
        help="usage on every chunk of every stream and a final usage chunk, whatever "
        "stream_options says (as vLLM 0.32)")
    group.add_argument(
        "--disable-access-log-for-endpoints", default=None, metavar="PATHS",
        help="comma-separated paths left out of the access log, e.g. /health,/metrics")
    group.add_argument(
        "--h11-max-incomplete-event-size", type=int_at_least(1), default=4 * 1024 * 1024,
        help="largest incomplete HTTP event (headers or body) in bytes (default 4 MiB)")
    add_neutral_args(
        parser, NEUTRAL_FRONTEND_ARGS, _DEST,
        "vLLM's HTTP front-end flags with no effect here (accepted at the values shown, "
        "refused with the reason at any other)",
    )


def frontend_config(args: argparse.Namespace) -> FrontendConfig:
    """The flags checked (``ValueError`` naming the flag) and read into a config."""
    neutral_values(
        args, NEUTRAL_FRONTEND_ARGS, _DEST,
        lambda name, value: None if NEUTRAL_FRONTEND_ARGS[name].accepts(value)
        else NEUTRAL_FRONTEND_ARGS[name].note,
    )
    uvicorn: dict[str, Any] = {"h11_max_incomplete_event_size": args.h11_max_incomplete_event_size}
    if args.ssl_keyfile or args.ssl_certfile:
        for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile),
                           ("--ssl-ca-certs", args.ssl_ca_certs)):
            if flag != "--ssl-ca-certs" and path is None:
                raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{flag} {path}: no such file")
        _check_tls(args)
        uvicorn.update(ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                       ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
                       ssl_ciphers=args.ssl_ciphers or "TLSv1")
    elif args.ssl_ca_certs or args.ssl_ciphers:
        raise ValueError("--ssl-ca-certs and --ssl-ciphers need --ssl-keyfile and --ssl-certfile")
    if args.uds is not None:
        uvicorn["uds"] = args.uds
    quiet = (args.disable_access_log_for_endpoints or "").split(",")
    return FrontendConfig(
        allowed_origins=tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers),
        allow_credentials=args.allow_credentials,
        enable_request_id_headers=args.enable_request_id_headers,
        middleware=tuple(_import_middleware(path) for path in args.middleware),
        enable_force_include_usage=args.enable_force_include_usage,
        quiet_endpoints=tuple(path.strip() for path in quiet if path.strip()),
        uvicorn=tuple(uvicorn.items()),
    )


def install_frontend(app: Any, config: FrontendConfig) -> None:
    """CORS, the X-Request-Id header and the user's middleware on ``app``, as vLLM orders
    them (the last added runs first)."""
    from starlette.middleware.cors import CORSMiddleware

    app.add_middleware(
        CORSMiddleware, allow_origins=list(config.allowed_origins),
        allow_credentials=config.allow_credentials, allow_methods=list(config.allowed_methods),
        allow_headers=list(config.allowed_headers),
    )
    if config.enable_request_id_headers:
        app.add_middleware(RequestIdHeaderMiddleware)
    for middleware in config.middleware:
        if inspect.isclass(middleware):
            app.add_middleware(middleware)
        else:
            app.middleware("http")(middleware)
    if config.quiet_endpoints:
        logging.getLogger("uvicorn.access").addFilter(_QuietEndpoints(config.quiet_endpoints))


class RequestIdHeaderMiddleware:
    """vLLM's ``--enable-request-id-headers``: every HTTP response carries ``X-Request-Id``,
    the request's own header if it sent one, else a fresh hex id (pure ASGI, so streams
    pass through untouched)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"x-request-id")
        request_id = given or uuid.uuid4().hex.encode()

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class _QuietEndpoints(logging.Filter):
    """Leaves uvicorn's access-log lines for these paths out (their query strings too)."""

    def __init__(self, paths: tuple[str, ...]) -> None:
        super().__init__()
        self.paths = frozenset(paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].split("?", 1)[0] not in self.paths  # (client, method, path, ...)
        return True


def _check_tls(args: argparse.Namespace) -> None:
    """The certificate, key, CA file and ciphers loaded as uvicorn will load them, so a
    wrong file is refused by name before the model loads (not "[SSL] PEM lib" after)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile, password=lambda: b"")
    except (ssl.SSLError, OSError) as error:
        raise ValueError(
            f"--ssl-certfile {args.ssl_certfile} / --ssl-keyfile {args.ssl_keyfile}: cannot "
            f"load the certificate and key (PEM, the key unencrypted): {error}") from None
    if args.ssl_ca_certs is not None:
        try:
            context.load_verify_locations(args.ssl_ca_certs)
        except (ssl.SSLError, OSError) as error:
            raise ValueError(f"--ssl-ca-certs {args.ssl_ca_certs}: {error}") from None
    if args.ssl_ciphers is not None:
        try:
            context.set_ciphers(args.ssl_ciphers)
        except ssl.SSLError as error:
            reason = " ".join(str(arg) for arg in error.args)  # ('No cipher ...',)
            raise ValueError(f"--ssl-ciphers {args.ssl_ciphers}: {reason}") from None


def _import_middleware(path: str) -> Any:
    """``module.name`` imported: a class or a coroutine function, else ``ValueError``."""
    module_path, _, name = path.rpartition(".")
    try:
        imported = getattr(importlib.import_module(module_path), name) if module_path else None
    except (ImportError, AttributeError) as error:
        raise ValueError(f"--middleware {path}: cannot import it: {error}") from None
    except Exception as error:  # the module's own fault (SyntaxError, ...): one line too
        raise ValueError(
            f"--middleware {path}: cannot import it: {type(error).__name__}: {error}"
        ) from None
    if imported is None:
        raise ValueError(f"--middleware {path}: give an import path, module.name")
    if not (inspect.isclass(imported) or inspect.iscoroutinefunction(imported)):
        raise ValueError(f"--middleware {path}: must be a class or a coroutine function")
    return imported


def _json_list(text: str) -> list[str]:
    """A JSON list of strings, as vLLM reads ``--allowed-origins``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"not a JSON list: {text!r} (write '[\"*\"]')") from None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r}")
    return value
