"""Every error the server returns, in OpenAI's shape and with the matching HTTP status.

::

    HTTP 4xx/5xx  {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

Handlers raise :class:`OpenAIError` (or let pydantic's ``ValidationError`` or the engine's
``ValueError`` through the helpers below); :func:`install_error_handlers` turns those, and
FastAPI's own 404/405, into that body, so no route ever answers with another shape.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from inflight.engine.request_stream import EngineDeadError

logger = logging.getLogger(__name__)

# OpenAI's error types: client mistakes (any 4xx, auth and unknown model included) are
# all "invalid_request_error", told apart by ``code``; our own failures are "server_error".
INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


# What a union-typed field accepts, for error messages.
_EXPECTED = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "messages": "a list of {role, content} objects with string or text-part content",
    "input": "a string or a list of input items (messages, function calls and their outputs)",
}


class OpenAIError(Exception):
    """An error answer: status, message and OpenAI's ``type``/``param``/``code``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = dict(self.headers)
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


# Seconds a client refused by backpressure is told to wait (Retry-After): a request
# slot frees within about a step, but one second keeps retry storms down.
RETRY_AFTER_S = 1


class StepRefusedError(EngineDeadError):
    """A request that runs several engine requests in turn (a beam search) had one refused
    after its answer began (overloaded, shutting down) or cut short: it fails with
    ``openai_error``, as the status of a whole answer or in-band in a stream."""

    def __init__(self, openai_error: OpenAIError) -> None:
        super().__init__(openai_error.message)
        self.openai_error = openai_error



def overloaded(message: str) -> OpenAIError:
    """Backpressure (max_waiting_requests): 503 with Retry-After, as OpenAI's overloaded
    answer; the client should retry."""
    return OpenAIError(
        503, message, SERVER_ERROR, code="engine_overloaded",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def request_timeout(message: str) -> OpenAIError:
    """A request aborted at its deadline (request_timeout): 504, as a gateway that gave
    up waiting (408 would mean the client was too slow to send its request)."""
    return OpenAIError(504, message, SERVER_ERROR, param="request_timeout", code="request_timeout")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, INVALID_REQUEST, param, code)


def from_validation_error(error: ValidationError) -> OpenAIError:
    """The first problem pydantic found, named by its top-level field."""
    first = error.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return bad_request(
            f"We could not parse the JSON body of your request ({first['msg']}). "
            "The body must be a JSON object.",
            code="invalid_json",
        )
    location = [str(part) for part in first["loc"]]
    if not location:
        return bad_request(f"The request body must be a JSON object: {first['msg']}")
    param = location[0]
    if first["type"] == "missing":
        # The full path, as OpenAI names it: 'messages[0].role', not 'messages'.
        path = _path(first["loc"])
        return bad_request(
            f"Missing required parameter: '{path}'.", path, "missing_required_parameter"
        )
    if sum(1 for e in error.errors() if e["loc"][:1] == first["loc"][:1]) > 1:
        # A union (prompt, stop, content): pydantic reports one error per alternative.
        expected = _EXPECTED.get(param, "a value of another type")
        return bad_request(
            f"Invalid type for '{param}': expected {expected}.", param, "invalid_type"
        )
    code = "invalid_type" if first["type"].endswith("_type") else "invalid_value"
    got = repr(first.get("input"))
    if len(got) > 60:
        got = got[:57] + "..."
    return bad_request(f"Invalid value for '{param}': {first['msg']} (got {got}).", param, code)


def _path(location: tuple[int | str, ...]) -> str:
    """pydantic's error location as OpenAI writes a parameter: ``messages[0].role``."""
    path = ""
    for part in location:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path


def from_engine_error(error: Exception) -> OpenAIError:
    """A request the engine rejected (``ValueError``/``TypeError``) is the client's fault."""
    message = str(error)
    param = None
    if message.startswith("SamplingParams: "):
        message = message.removeprefix("SamplingParams: ")
        param = message.split(" ", 1)[0]
    elif any(word in message for word in ("prompt", "token id", "max_model_len", "KV blocks")):
        param = "prompt"
    param = getattr(error, "parameter", None) or param  # InvalidRequestError names it
    code = "context_length_exceeded" if "max_model_len" in message else None
    return bad_request(message, param, code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, error: OpenAIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {"msg": "invalid request"}
        return bad_request(f"Invalid request: {first['msg']}").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        if error.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        else:
            message = (
                f"{HTTPStatus(error.status_code).phrase} ({request.method} {request.url.path})"
            )
        kind = INVALID_REQUEST if error.status_code < 500 else SERVER_ERROR
        return OpenAIError(error.status_code, message, kind).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return OpenAIError(500, f"Internal server error: {error!r}", SERVER_ERROR).response()
