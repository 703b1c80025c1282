"""schemathesis drives the server's published OpenAPI schema (``/openapi.json``).

First, the schema is truthful about the generation routes: their request bodies are the
pydantic request models (not missing, as FastAPI would infer for routes that read the raw
request), and their answers are the response models or OpenAI's error body. Then
schemathesis generates cases for every operation, from the schema (positive) and against
it (negative), and every answer must pass: no 5xx, a 4xx in OpenAI's error shape, and
the response conforming to the published schema. Bounded per operation; derandomized.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from fuzz_server import FuzzServer, Tally, assert_openai_error
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

TALLY = Tally()
MAX_EXAMPLES = 40
BODY_ROUTES = {
    "/v1/completions": "CompletionRequest",
    "/v1/chat/completions": "ChatCompletionRequest",
    "/v1/responses": "ResponsesRequest",
    "/tokenize": "TokenizeRequest",
    "/detokenize": "DetokenizeRequest",
}


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[FuzzServer]:
    fuzz_server = FuzzServer(tiny_llama_dir).start()
    yield fuzz_server
    fuzz_server.stop()


@pytest.fixture(scope="module")
def published(server: FuzzServer) -> dict[str, Any]:
    response = httpx.get(f"{server.url}/openapi.json")
    assert response.status_code == 200
    return dict(response.json())


def test_published_schema_describes_request_bodies(published: dict[str, Any]) -> None:
    components = published["components"]["schemas"]
    for path, model in BODY_ROUTES.items():
        operation = published["paths"][path]["post"]
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert operation["requestBody"]["required"] is True
        assert "4XX" in operation["responses"]
    completion = components["CompletionRequest"]
    assert "prompt" in completion["required"]
    assert {"max_tokens", "temperature", "logit_bias", "stop"} <= set(completion["properties"])
    assert "messages" in components["ChatCompletionRequest"]["required"]
    error = components["ErrorInfo"]
    assert set(error["properties"]) == {"message", "type", "param", "code"}


def _operations(server: FuzzServer) -> list[Any]:
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def test_schemathesis_every_operation(
    server: FuzzServer, report_figure: Callable[[str], None]
) -> None:
    greedy_alone = server.greedy_text()
    operations = _operations(server)
    assert {op.path for op in operations} >= set(BODY_ROUTES)
    for operation in operations:
        for mode in schemathesis.GenerationMode:  # from the schema, then against it
            _fuzz(server, operation, mode)
    report_figure(f"schemathesis cases tried: {TALLY.total} {TALLY.counts}")
    assert TALLY.counts.get("5xx", 0) == 0
    server.assert_healthy(greedy_alone)


def _fuzz(server: FuzzServer, operation: Any, mode: schemathesis.GenerationMode) -> None:
    # Response conformance only where the schema states the answers (generation routes);
    # /metrics answers Prometheus text, /health an empty 200, which FastAPI publishes as
    # "any JSON".
    checks = [not_a_server_error]
    if operation.path in BODY_ROUTES and mode is schemathesis.GenerationMode.POSITIVE:
        checks += [response_schema_conformance, content_type_conformance,
                   status_code_conformance]

    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        if isinstance(case.body, dict) and mode is schemathesis.GenerationMode.POSITIVE:
            # Bound the cost of the cases the server accepts: a few tokens each.
            if operation.path == "/v1/responses":
                case.body["max_output_tokens"] = 2
            else:
                case.body["max_tokens"] = 2
                case.body.pop("max_completion_tokens", None)
                case.body["n"] = 1
        response = case.call(base_url=server.url, timeout=60)
        TALLY.add(response.status_code)
        case.validate_response(response, checks=checks)
        if response.status_code >= 400:
            assert_openai_error(response.json())

    try:
        run()
    except Unsatisfiable:  # nothing to violate: an operation without any parameter
        assert mode is schemathesis.GenerationMode.NEGATIVE
