"""Graceful shutdown: stop accepting, finish (or, past the grace period, abort) cleanly."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from server_harness import ServerProcess, free_port

from helpers.step_gate import StepGate, once_all_have
from inflight.engine.async_engine import AsyncLLMEngine
from inflight.entrypoints.openai.api_server import GracefulServer, build_app
from inflight.entrypoints.openai.serving import ServerConfig


def stream_completion(
    url: str, max_tokens: int, out: dict[str, Any], first_token: threading.Event
) -> None:
    """Read one streaming completion to its end, recording tokens and how it ended."""
    body = {
        "prompt": "w3 w4 w5",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    out["tokens"], out["finish_reason"], out["done"] = 0, None, False
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line == "data: [DONE]":
                out["done"] = True
            elif line.startswith("data:"):
                choice = json.loads(line[5:])["choices"][0]
                out["tokens"] += 1
                out["finish_reason"] = choice["finish_reason"]
                first_token.set()


def start_streams(
    url: str, lengths: list[int]
) -> tuple[list[threading.Thread], list[dict[str, Any]]]:
    """Start one streaming request per length; return once each has its first token."""
    results: list[dict[str, Any]] = [{} for _ in lengths]
    started = [threading.Event() for _ in lengths]
    workers = [
        threading.Thread(target=stream_completion, args=(url, n, results[i], started[i]))
        for i, n in enumerate(lengths)
    ]
    for worker in workers:
        worker.start()
    for event in started:
        assert event.wait(60)
    return workers, results


def test_sigterm_lets_requests_in_flight_finish_then_exits_zero(
    tiny_llama_dir: Path, start_server: Callable[..., ServerProcess]
) -> None:
    server = start_server(str(tiny_llama_dir))  # default grace period: 30 s
    workers, results = start_streams(server.url, [20, 200])
    server.process.send_signal(signal.SIGTERM)
    for worker in workers:
        worker.join(60)
    assert server.process.wait(60) == 0
    assert results == [
        {"tokens": 20, "finish_reason": "length", "done": True},
        {"tokens": 200, "finish_reason": "length", "done": True},
    ]
    with pytest.raises(httpx.ConnectError):  # no longer accepting
        httpx.get(f"{server.url}/health")
    assert "Application shutdown complete" in server.log()


def test_requests_past_the_grace_period_are_aborted_cleanly(tiny_llama_dir: Path) -> None:
    """In-process, so no signal: ``should_exit`` is what uvicorn's signal handler sets."""
    engine = AsyncLLMEngine.from_options(str(tiny_llama_dir))
    # Once every stream has its first token the engine makes no progress, so none can
    # finish before the shutdown, however fast the machine; the abort ends the hold.
    gate = StepGate(engine._engine, once_all_have(1))
    app = build_app(engine, ServerConfig(served_model_names=("tiny",)))
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    server = GracefulServer(config, engine, grace_s=0.0)
    thread = threading.Thread(target=server.run)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        while not server.started:
            assert thread.is_alive()
            time.sleep(0.05)
        workers, results = start_streams(url, [480, 480, 480])
        server.should_exit = True
        for worker in workers:
            worker.join(60)
    finally:
        server.should_exit = True
        thread.join(60)
    assert not gate.gave_up
    for result in results:
        # Cut short, but cleanly: a final chunk with finish_reason "abort", then [DONE].
        assert result["finish_reason"] == "abort" and result["done"], result
        assert result["tokens"] < 480
    assert not thread.is_alive()
    assert not engine.is_healthy  # the lifespan stopped the engine thread
