"""Two tiny-model replicas in a local Ray cluster (loopback) behind one OpenAI endpoint.

The server is the real app on uvicorn, on a thread of this process, so the test holds
the replicas' actor handles (to kill one). Expected texts come from one engine serving
each prompt alone (greedy), never from the replicas themselves.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'inflight[ray]')")
httpx = pytest.importorskip("httpx")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from inflight.distributed.client import (  # noqa: E402
    DataParallelConfig,
    DataParallelEngineClient,
    init_ray,
)
from inflight.entrypoints.openai.api_server import GracefulServer, build_app  # noqa: E402
from inflight.entrypoints.openai.serving import ServerConfig  # noqa: E402

MAX_TOKENS = 12
LONG_TOKENS = 96  # long enough that a replica is still streaming when it is killed
PROMPTS = [" ".join(f"w{(7 * i + 3 * j) % 500 + 3}" for j in range(6 + i)) for i in range(8)]


@dataclass
class DataParallelServer:
    client: DataParallelEngineClient
    url: str

    def complete(self, prompt: str, max_tokens: int = MAX_TOKENS) -> httpx.Response:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}
        return httpx.post(f"{self.url}/v1/completions", json=body, timeout=120)

    def health(self) -> tuple[int, dict[str, Any]]:
        response = httpx.get(f"{self.url}/health", timeout=30)
        return response.status_code, response.json()

    def metric(self, name: str) -> dict[str, float]:
        """``name``'s samples summed per replica label."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        per_replica: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name:
                    replica = sample.labels["replica"]
                    per_replica[replica] = per_replica.get(replica, 0.0) + sample.value
        return per_replica


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_for(condition: Any, what: str, timeout_s: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def reference_texts(tiny_llama_dir: Path) -> dict[tuple[str, int], str]:
    """Each prompt served alone by one engine in this process."""
    from inflight import LLM, SamplingParams

    llm = LLM(str(tiny_llama_dir))
    texts = {}
    for max_tokens in (MAX_TOKENS, LONG_TOKENS):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        for prompt in PROMPTS:
            output = llm.generate([prompt], params, use_tqdm=False)[0]
            texts[prompt, max_tokens] = output.outputs[0].text
    return texts


@pytest.fixture(scope="module")
def dp_server(tiny_llama_dir: Path) -> Iterator[DataParallelServer]:
    import uvicorn

    config = DataParallelConfig(data_parallel_size=2, health_check_interval_s=0.1)
    try:
        init_ray(ray, config)
    except Exception as error:  # noqa: BLE001 - any reason ray cannot start here
        pytest.skip(f"a local Ray cluster cannot start here: {error}")
    try:
        client = DataParallelEngineClient(str(tiny_llama_dir), {}, config)
        app = build_app(client, ServerConfig(served_model_names=("tiny",)))
        port = _free_port()
        server = GracefulServer(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"),
            client, grace_s=5.0,
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        _wait_for(lambda: server.started or not thread.is_alive(), "the server to listen")
        assert thread.is_alive(), "the server did not start"
        yield DataParallelServer(client, f"http://127.0.0.1:{port}")
        server.should_exit = True
        thread.join(60)
    finally:
        ray.shutdown()


def test_concurrent_requests_match_one_engine_and_both_replicas_serve(
    dp_server: DataParallelServer, reference_texts: dict[tuple[str, int], str]
) -> None:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        responses = list(pool.map(dp_server.complete, PROMPTS))
    assert [r.status_code for r in responses] == [200] * len(PROMPTS)
    texts = [r.json()["choices"][0]["text"] for r in responses]
    assert texts == [reference_texts[p, MAX_TOKENS] for p in PROMPTS]
    routed = dp_server.metric("inflight:replica_requests_routed_total")
    assert routed["0"] > 0 and routed["1"] > 0 and sum(routed.values()) == len(PROMPTS)
    # The replicas' own engines counted the work (their stats reach /metrics by polling).
    finished = _wait_for(
        lambda: (m := dp_server.metric("inflight:request_success_total"))
        and sum(m.values()) == len(PROMPTS) and m,
        "both replicas' finished requests in /metrics",
    )
    assert finished["0"] == routed["0"] and finished["1"] == routed["1"]
    generated = dp_server.metric("inflight:generation_tokens_total")
    assert sum(generated.values()) == MAX_TOKENS * len(PROMPTS)


def test_health_reports_each_replica(dp_server: DataParallelServer) -> None:
    status, body = dp_server.health()
    assert status == 200
    assert body["status"] == "ok"
    assert [r["replica"] for r in body["replicas"]] == [0, 1]
    assert all(r["state"] == "alive" for r in body["replicas"])


def test_shared_prefix_goes_to_the_replica_that_caches_it(dp_server: DataParallelServer) -> None:
    # 40 shared words: the first two 16-token KV blocks of both prompts are equal.
    prefix = " ".join(f"w{400 + j}" for j in range(40))
    routed = [dp_server.metric("inflight:replica_requests_routed_total")]
    usages = []
    for suffix in ("w11", "w12"):
        response = dp_server.complete(f"{prefix} {suffix}")
        assert response.status_code == 200
        usages.append(response.json()["usage"])
        routed.append(dp_server.metric("inflight:replica_requests_routed_total"))
    served = [
        next(r for r in after if after[r] > before[r])
        for before, after in zip(routed, routed[1:], strict=False)
    ]
    # Both idle: load alone would have alternated replicas; the prefix keeps them together
    # and the second request finds its first two blocks in that replica's prefix cache.
    assert served[0] == served[1]
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] == 32


def _stream(server: DataParallelServer, prompt: str, started: threading.Event) -> dict[str, Any]:
    """A streaming completion: its text, and the in-band error if one came."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": LONG_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    text, error = "", None
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                error = event["error"]
                continue
            text += event["choices"][0]["text"]
            started.set()
    started.set()
    return {"text": text, "error": error}


def test_killing_a_replica_mid_run_keeps_the_service_answering(
    dp_server: DataParallelServer, reference_texts: dict[tuple[str, int], str]
) -> None:
    victim = 1
    streaming = PROMPTS[:4]
    events = [threading.Event() for _ in streaming]
    with ThreadPoolExecutor(8) as pool:
        streams = [pool.submit(_stream, dp_server, p, e) for p, e in zip(streaming, events, strict=True)]
        _wait_for(lambda: all(e.is_set() for e in events), "every stream's first tokens")
        # Non-streaming requests race the kill: each must succeed or get a clean 503.
        racing = [pool.submit(dp_server.complete, p, LONG_TOKENS) for p in PROMPTS[4:]]
        ray.kill(dp_server.client.replica_handles[victim], no_restart=False)
        stream_results = [f.result() for f in streams]
        racing_results = [f.result() for f in racing]

    for prompt, result in zip(streaming, stream_results, strict=True):
        if result["error"] is None:  # finished before the kill, or served by the survivor
            assert result["text"] == reference_texts[prompt, LONG_TOKENS]
        else:  # its replica died after streaming: a clean error naming the cause
            assert "replica" in result["error"]["message"]
            assert reference_texts[prompt, LONG_TOKENS].startswith(result["text"])
    for prompt, response in zip(PROMPTS[4:], racing_results, strict=True):
        if response.status_code == 200:
            assert response.json()["choices"][0]["text"] == reference_texts[prompt, LONG_TOKENS]
        else:
            assert response.status_code == 503, response.text
            assert response.json()["error"]["type"] == "server_error"

    # The service answers right after the kill, whether or not Ray has restarted it yet.
    after = [dp_server.complete(p) for p in PROMPTS[:3]]
    assert [r.status_code for r in after] == [200] * 3
    assert [r.json()["choices"][0]["text"] for r in after] == [
        reference_texts[p, MAX_TOKENS] for p in PROMPTS[:3]
    ]

    # Ray restarts the replica; it comes back into rotation and serves again.
    def restarted() -> bool:
        status, body = dp_server.health()
        replica = body["replicas"][victim]
        return status == 200 and replica["state"] == "alive" and replica["num_restarts"] == 1

    _wait_for(restarted, "the killed replica to be restarted and back in rotation")
    assert dp_server.metric("inflight:replica_restarts_total")[str(victim)] == 1
    routed_before = dp_server.metric("inflight:replica_requests_routed_total")
    with ThreadPoolExecutor(4) as pool:
        again = list(pool.map(dp_server.complete, PROMPTS[4:]))
    assert [r.json()["choices"][0]["text"] for r in again] == [
        reference_texts[p, MAX_TOKENS] for p in PROMPTS[4:]
    ]
    routed_after = dp_server.metric("inflight:replica_requests_routed_total")
    assert routed_after[str(victim)] > routed_before[str(victim)]
