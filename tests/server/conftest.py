"""Fixtures that run the real server (``inflight serve``) in a subprocess on a free port.

One tiny-model server is shared by the whole session (API key and a chat template set),
so most tests pay no start-up cost; tests that kill their server start their own.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
from server_harness import API_KEY, CHAT_TEMPLATE, ServerProcess

from inflight import LLM


@pytest.fixture(scope="session")
def start_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., ServerProcess]]:
    """Start servers on demand; every one still running is stopped at the end."""
    started: list[ServerProcess] = []

    def start(*args: str) -> ServerProcess:
        log = tmp_path_factory.mktemp("server") / "server.log"
        server = ServerProcess(list(args), log)
        started.append(server)
        server.wait_ready()
        return server

    yield start
    # Ctrl-C is the other graceful-shutdown signal (the shutdown test sends SIGTERM):
    # every server still up at the end must exit 0 on it.
    still_running = [s for s in started if s.process.poll() is None]
    exit_codes = [s.stop(signal.SIGINT) for s in still_running]
    assert exit_codes == [0] * len(still_running), [s.log() for s in still_running]


@pytest.fixture(scope="session")
def tiny_server(tiny_llama_dir: Path, start_server: Callable[..., ServerProcess]) -> ServerProcess:
    return start_server(
        str(tiny_llama_dir),
        "--api-key",
        API_KEY,
        "--chat-template",
        CHAT_TEMPLATE,
        "--served-model-name",
        "tiny",
        "tiny-alias",
        "--max-num-seqs",
        "32",
        "--trust-request-chat-template",  # the tests send templates (one test refuses them)
    )


@pytest.fixture(scope="module")
def client(tiny_server: ServerProcess) -> openai.OpenAI:
    """The official client on the shared tiny-model server."""
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: Path) -> LLM:
    """The same tiny model offline: what the server's answers must equal."""
    return LLM(str(tiny_llama_dir))
