"""Running ``inflight serve`` in a subprocess for tests: free port, readiness, stopping."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

API_KEY = "sk-inflight-test"
# The tiny model has no chat template: this one joins the messages' contents with spaces.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def scrape_metrics(url: str) -> dict[str, float]:
    """``/metrics`` as {sample name with its labels: value}, plus each family's first
    sample under the bare family name (the single-engine gauges and counters)."""
    samples: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
            samples.setdefault(name.split("{")[0], float(value))
    return samples


def abort_count(samples: dict[str, float]) -> float:
    """Requests that ended aborted, from :func:`scrape_metrics`' labelled samples."""
    return sum(v for k, v in samples.items() if 'finished_reason="abort"' in k)


def words(count: int, offset: int = 0, stride: int = 7) -> str:
    """A prompt of ``count`` distinct-ish words the tiny tokenizer knows."""
    return " ".join(f"w{3 + (offset + i * stride) % 500}" for i in range(count))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """``python -m inflight.entrypoints.cli serve ...`` with its log in a file."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [
            sys.executable,
            "-m",
            "inflight.entrypoints.cli",
            "serve",
            *args,
            "--port",
            str(self.port),
            "--disable-uvicorn-access-log",
        ]
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited ({self.process.returncode}):\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"the server did not become healthy:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise
