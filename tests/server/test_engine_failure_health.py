"""A model forward that raises fails only the requests of that step, with a 500 that
carries the reason; later requests are served; failures that repeat mark the engine
unhealthy (``/health`` 503, new requests 503) so an orchestrator restarts the process.

The fault is injected into the model's forward of an in-process server (the request
passes validation and fails during a step); nothing here waits on the machine's speed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from inprocess_server import InProcessServer

from inflight.engine.async_engine import DEFAULT_MAX_CONSECUTIVE_STEP_FAILURES

PROMPT = [5, 6, 7, 8]
BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True}


class ForwardFaults:
    """Wraps the model's forward: the next ``failures`` calls raise."""

    def __init__(self, server: InProcessServer) -> None:
        self.failures = 0
        self.calls = 0
        model = server.engine.runner.model
        self._original = model.forward
        model.forward = self._forward  # nn.Module.__call__ looks it up on the instance

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("injected forward fault")
        return self._original(*args, **kwargs)


@pytest.fixture
def server(tiny_llama_dir: Path) -> Iterator[InProcessServer]:
    server = InProcessServer(tiny_llama_dir).start()
    yield server
    server.stop()


def complete(server: InProcessServer, body: dict[str, Any] = BODY) -> httpx.Response:
    # The timeout only fails a server that hangs; a healthy answer comes in far less.
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)


def assert_failed_with_reason(response: httpx.Response) -> None:
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["type"] == "server_error"
    assert "injected forward fault" in error["message"]


def assert_engine_clean(server: InProcessServer) -> None:
    engine = server.engine
    assert not engine.has_unfinished_requests()
    engine.scheduler.check_invariants()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_one_failing_step_fails_its_request_and_the_next_is_served(
    server: InProcessServer,
) -> None:
    reference = complete(server).json()["choices"][0]["token_ids"]
    faults = ForwardFaults(server)
    faults.failures = 1
    assert_failed_with_reason(complete(server))
    # A streaming request failing the same way ends with an error event and [DONE].
    faults.failures = 1
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**BODY, "stream": True},
                      timeout=120) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines()
                  if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    assert "injected forward fault" in json.loads(events[-2])["error"]["message"]
    assert_engine_clean(server)
    served = complete(server)
    assert served.status_code == 200
    assert served.json()["choices"][0]["token_ids"] == reference
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_successful_step_resets_the_failure_count(server: InProcessServer) -> None:
    faults = ForwardFaults(server)
    for _ in range(3):
        faults.failures = DEFAULT_MAX_CONSECUTIVE_STEP_FAILURES - 1
        for _ in range(DEFAULT_MAX_CONSECUTIVE_STEP_FAILURES - 1):
            assert_failed_with_reason(complete(server))
        assert complete(server).status_code == 200  # resets the count
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_repeated_failures_mark_the_engine_unhealthy(server: InProcessServer) -> None:
    faults = ForwardFaults(server)
    faults.failures = 1_000  # the forward keeps failing
    for _ in range(DEFAULT_MAX_CONSECUTIVE_STEP_FAILURES):
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert httpx.post(f"{server.url}/ping").status_code == 200
        assert_failed_with_reason(complete(server))
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 503
    # vLLM's /ping (GET or POST) answers as /health does.
    assert httpx.get(f"{server.url}/ping").status_code == 503
    assert httpx.post(f"{server.url}/ping").status_code == 503
    message = health.json()["error"]["message"]
    assert "unhealthy" in message and "injected forward fault" in message
    assert f"{DEFAULT_MAX_CONSECUTIVE_STEP_FAILURES} consecutive steps failed" in message
    # New requests are refused at once, without reaching the model.
    calls = faults.calls
    for route, body in (
        ("/v1/completions", BODY),
        ("/v1/chat/completions", {"model": "tiny", "max_tokens": 2, "chat_template": "{{ 'w5' }}",
                                  "messages": [{"role": "user", "content": "w5"}]}),
    ):
        refused = httpx.post(f"{server.url}{route}", json=body, timeout=120)
        assert refused.status_code == 503, refused.text
        assert "unhealthy" in refused.json()["error"]["message"]
    assert faults.calls == calls
    assert_engine_clean(server)
    # The process is not half-alive: the engine thread still answers and shuts down.
    assert server.async_engine._thread is not None and server.async_engine._thread.is_alive()
