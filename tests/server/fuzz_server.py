"""An in-process server for the fuzz tests, and the checks every fuzzed answer must pass.

Every answer is either a 2xx whose body is valid (choices present, usage adding up,
streams made of JSON chunks ending in ``[DONE]``) or a 4xx in OpenAI's error shape; a 5xx
or a client timeout fails the test.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from server_harness import CHAT_TEMPLATE, free_port

from inflight.engine.async_engine import AsyncLLMEngine
from inflight.entrypoints.openai.api_server import GracefulServer, build_app
from inflight.entrypoints.openai.serving import ServerConfig

GREEDY_BODY = {"model": "tiny", "prompt": "w40 w41 w42", "max_tokens": 8, "temperature": 0,
               "ignore_eos": True}
CLIENT_TIMEOUT_S = 60.0  # a hang is a failure, not a wait
FINISH_REASONS = {"stop", "length", "abort", "tool_calls", None}


class FuzzServer:
    """The real app under uvicorn on a thread, with a chat template so chat can succeed;
    ``max_model_len`` small so that no accepted request costs more than a moment."""

    def __init__(self, model_dir: Path, max_model_len: int = 64) -> None:
        self.engine = AsyncLLMEngine.from_options(
            str(model_dir), max_model_len=max_model_len, max_num_seqs=16
        )
        config = ServerConfig(served_model_names=("tiny",), chat_template=CHAT_TEMPLATE)
        self.app = build_app(self.engine, config)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        uv_config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                   log_level="critical")
        self.server = GracefulServer(uv_config, self.engine, grace_s=5.0)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.client = httpx.Client(base_url=self.url, timeout=CLIENT_TIMEOUT_S)

    def start(self, timeout_s: float = 300.0) -> FuzzServer:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "no server"
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.client.close()
        self.server.should_exit = True
        self.thread.join(60.0)

    def greedy_text(self) -> str:
        response = self.client.post("/v1/completions", json=GREEDY_BODY)
        assert response.status_code == 200, response.text
        return str(response.json()["choices"][0]["text"])

    def assert_healthy(self, greedy_alone: str) -> None:
        assert self.client.get("/health").status_code == 200
        assert self.greedy_text() == greedy_alone
        kv = self.engine._engine.kv_cache
        # Every response has been read, so every request has finished or been aborted.
        deadline = time.monotonic() + 30.0
        while kv.num_free_blocks != kv.num_blocks and time.monotonic() < deadline:
            time.sleep(0.05)
        assert kv.num_free_blocks == kv.num_blocks, "KV blocks leaked"


@dataclass
class Tally:
    """Cases tried, by outcome (printed for the README's figures)."""

    counts: dict[str, int] = field(default_factory=dict)

    def add(self, status: int) -> None:
        key = f"{status // 100}xx"
        self.counts[key] = self.counts.get(key, 0) + 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def assert_openai_error(body: Any) -> None:
    """``{"error": {"message": str, "type": str, "param": ..., "code": ...}}``."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error), error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)


def _assert_usage(usage: dict[str, Any]) -> None:
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    assert prompt >= 0 and completion >= 0
    assert usage["total_tokens"] == prompt + completion, usage


def _assert_choices(choices: Any, chat: bool) -> None:
    assert isinstance(choices, list) and choices
    for choice in choices:
        assert isinstance(choice["index"], int)
        assert choice["finish_reason"] in FINISH_REASONS, choice
        if chat:
            assert choice["message"]["role"] == "assistant"
        else:
            assert isinstance(choice["text"], str)


def _assert_stream(text: str, chat: bool) -> None:
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", text[-300:]
    for event in events[:-1]:
        chunk = json.loads(event)
        assert "error" not in chunk, chunk
        assert isinstance(chunk["choices"], list)
        if chunk.get("usage"):
            _assert_usage(chunk["usage"])


def check_response(response: httpx.Response, chat: bool, tally: Tally) -> None:
    """2xx with a valid body, or 4xx in OpenAI's error shape; anything else fails."""
    tally.add(response.status_code)
    status = response.status_code
    assert status < 500, f"{status}: {response.text[:500]}"
    if status >= 400:
        assert_openai_error(response.json())
        return
    assert status == 200, response.text[:300]
    if response.headers["content-type"].startswith("text/event-stream"):
        _assert_stream(response.text, chat)
        return
    body = response.json()
    _assert_choices(body["choices"], chat)
    if chat or body.get("usage") is not None:
        _assert_usage(body["usage"])
        token_ids = [c.get("token_ids") for c in body["choices"]]
        if all(isinstance(t, list) for t in token_ids):  # return_token_ids: exact count
            assert body["usage"]["completion_tokens"] == sum(len(t) for t in token_ids)
