"""The real app and uvicorn server on a thread of the test process, with its engine at hand.

Tests that must hold the engine at a state (see ``helpers.step_gate``) need the engine
object itself, which a server in a subprocess does not give them.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import uvicorn
from server_harness import free_port

from inflight.engine.async_engine import AsyncLLMEngine
from inflight.engine.llm_engine import LLMEngine
from inflight.entrypoints.openai.api_server import GracefulServer, build_app
from inflight.entrypoints.openai.serving import ServerConfig


class InProcessServer:
    def __init__(
        self,
        model_dir: Path,
        *,
        api_key: str | None = None,
        grace_s: float = 30.0,
        trust_request_chat_template: bool = True,
        chat_template_content_format: str = "auto",
        chat_template: str | None = None,
        disable_fastapi_docs: bool = False,
        **engine_options: Any,
    ):
        self.async_engine = AsyncLLMEngine.from_options(str(model_dir), **engine_options)
        app = build_app(
            self.async_engine,
            ServerConfig(served_model_names=("tiny",), api_keys=(api_key,) if api_key else (),
                         trust_request_chat_template=trust_request_chat_template,
                         chat_template_content_format=chat_template_content_format,
                         chat_template=chat_template,
                         disable_fastapi_docs=disable_fastapi_docs),
        )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = GracefulServer(config, self.async_engine, grace_s=grace_s)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def engine(self) -> LLMEngine:
        return self.async_engine._engine

    def start(self, timeout_s: float = 120.0) -> InProcessServer:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:  # uvicorn sets it once the socket listens
            assert self.thread.is_alive() and time.monotonic() < deadline, "no server"
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
