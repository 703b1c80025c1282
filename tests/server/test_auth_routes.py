"""With ``--api-key``, every route of the app refuses a missing or wrong key with 401,
except the few that are open on purpose: probes and scrapers (``/health``, ``/metrics``),
``/version``, the schema, and the stateless ``/tokenize`` and ``/detokenize`` (as in
vLLM, whose key guards ``/v1``). The routes are enumerated from ``app.routes``, so a new
route added without the key check fails here until it is protected or listed as open.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fuzz_server import assert_openai_error
from inprocess_server import InProcessServer
from server_harness import API_KEY
from starlette.routing import Route

import inflight.entrypoints.openai.api_server as api_server

# Open without a key, on purpose (none of them changes server state).
OPEN_ROUTES = {"/health", "/ping", "/metrics", "/version", "/openapi.json", "/tokenize", "/detokenize",
               "/docs", "/docs/oauth2-redirect", "/redoc"}  # FastAPI's pages: open in vLLM too
WRONG_CREDENTIALS: list[dict[str, str]] = [
    {},
    {"Authorization": ""},
    {"Authorization": "Bearer"},
    {"Authorization": "Bearer wrong"},
    {"Authorization": f"Bearer {API_KEY[:-1]}"},  # a prefix of the key
    {"Authorization": f"Bearer {API_KEY}x"},
    {"Authorization": f"Bearer {API_KEY[:-1]}X"},  # same length, last character wrong
    {"Authorization": API_KEY},  # no scheme
    {"Authorization": f"Basic {API_KEY}"},
    {"X-API-Key": API_KEY},
]


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[InProcessServer]:
    running = InProcessServer(tiny_llama_dir, api_key=API_KEY).start()
    yield running
    running.stop()


def _walk(routes: list[Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """(method, path template) of every route, included routers' routes too (FastAPI
    0.165 keeps an included router as one entry wrapping the original router)."""
    for route in routes:
        if isinstance(route, Route):
            for method in sorted(route.methods or ()):
                if method != "HEAD":
                    yield method, prefix + route.path
        elif hasattr(route, "original_router"):
            included_prefix = getattr(getattr(route, "include_context", None), "prefix", "")
            yield from _walk(route.original_router.routes, prefix + included_prefix)
        else:
            raise AssertionError(f"a route this test cannot enumerate: {route!r}")


def _routes(server: InProcessServer) -> list[tuple[str, str]]:
    """(method, concrete path) for every route the app serves."""
    app = server.server.config.app
    # Path parameters ({name:path}) get the served model's name.
    return [(m, re.sub(r"\{[^}]*\}", "tiny", p)) for m, p in _walk(app.routes)]


def _call(server: InProcessServer, method: str, path: str, headers: dict[str, str]) -> Any:
    body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 1, "tokens": [5]}
    return httpx.request(
        method, f"{server.url}{path}", headers=headers,
        json=body if method == "POST" else None, timeout=60,
    )


def test_routes_are_enumerated(server: InProcessServer) -> None:
    paths = {path for _, path in _routes(server)}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models",
            "/reset_prefix_cache"} <= paths
    assert OPEN_ROUTES <= paths


def test_every_protected_route_refuses_a_missing_or_wrong_key(server: InProcessServer) -> None:
    protected = [(m, p) for m, p in _routes(server) if p not in OPEN_ROUTES]
    assert protected
    for method, path in protected:
        for headers in WRONG_CREDENTIALS:
            response = _call(server, method, path, headers)
            assert response.status_code == 401, (method, path, headers, response.text)
            assert_openai_error(response.json())
            assert response.json()["error"]["code"] == "invalid_api_key"
            assert response.headers["www-authenticate"] == "Bearer"
        # The right key gets past the check (whatever the route then answers).
        authorised = _call(server, method, path, {"Authorization": f"Bearer {API_KEY}"})
        assert authorised.status_code != 401, (method, path, authorised.text)
        assert authorised.status_code < 500, (method, path, authorised.text)


def test_open_routes_need_no_key(server: InProcessServer) -> None:
    for method, path in _routes(server):
        if path in OPEN_ROUTES:
            response = _call(server, method, path, {})
            assert response.status_code == 200, (method, path, response.text)


def test_key_is_compared_in_constant_time(
    server: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guess is checked with ``hmac.compare_digest`` (its time does not depend on how
    many leading characters are right), never with ``==``."""
    compared: list[tuple[bytes, bytes]] = []
    compare_digest = hmac.compare_digest

    def recording_compare(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return compare_digest(a, b)

    monkeypatch.setattr(api_server.hmac, "compare_digest", recording_compare)
    wrong = f"{API_KEY[:-1]}X"
    assert _call(server, "GET", "/v1/models", {"Authorization": f"Bearer {wrong}"}).status_code \
        == 401
    assert _call(server, "GET", "/v1/models", {"Authorization": f"Bearer {API_KEY}"}).status_code \
        == 200
    assert compared == [(wrong.encode(), API_KEY.encode()), (API_KEY.encode(), API_KEY.encode())]
