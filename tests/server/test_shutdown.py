"""SIGTERM/SIGINT: stop accepting, finish or abort what is in flight cleanly, exit 0."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import ServerProcess


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


def test_sigterm_finishes_short_requests_and_aborts_long_ones(
    tiny_llama_dir: Path, start_server: Callable[..., ServerProcess]
) -> None:
    server = start_server(str(tiny_llama_dir), "--shutdown-timeout", "1.5")
    results: list[dict[str, Any]] = [{} for _ in range(4)]
    started = [threading.Event() for _ in range(4)]
    # One request short enough to finish within the grace period, three that cannot.
    lengths = [20, 480, 480, 480]
    workers = [
        threading.Thread(target=stream_completion, args=(server.url, n, results[i], started[i]))
        for i, n in enumerate(lengths)
    ]
    for worker in workers:
        worker.start()
    for event in started:
        assert event.wait(60)
    server.process.send_signal(signal.SIGTERM)
    for worker in workers:
        worker.join(60)
    assert server.process.wait(60) == 0
    short, *long = results
    assert short == {"tokens": 20, "finish_reason": "length", "done": True}
    for result in long:
        # Cut short at the end of the grace period, but cleanly: a final chunk, then [DONE].
        assert result["finish_reason"] == "abort" and result["done"], result
        assert result["tokens"] < 480
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health")
    assert "Application shutdown complete" in server.log()
