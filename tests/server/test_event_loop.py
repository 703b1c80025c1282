"""The event loop never blocks: big inputs are tokenised off it, abandoned requests never run.

* Dozens of requests whose prompts hold hundreds of thousands of words (refused for
  length, after tokenising) arrive together; ``/health`` and ``/metrics`` keep answering
  fast meanwhile, and a stream started before them keeps flowing to its right end.
* 200 non-streaming requests with long prompts whose clients give up after a second are
  aborted while they wait: the step trace never shows them, and a new request is
  answered at once.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from inprocess_server import InProcessServer
from server_harness import CHAT_TEMPLATE, ServerProcess, abort_count, scrape_metrics, words

from helpers.step_gate import StepGate

HUGE_WORDS = 150_000  # ~1 MB of JSON per request; ~0.4 s to tokenise
NUM_HUGE = 20
ABANDONED = 200


def huge_body(index: int) -> bytes:
    """Encoded once, up front: the client must not spend the test's time serialising."""
    text = words(HUGE_WORDS, offset=index)
    if index % 2:
        body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    else:
        body = {"model": "tiny", "prompt": text, "max_tokens": 4}
    return json.dumps(body).encode()


async def stream_text(client: httpx.AsyncClient, body: dict) -> str:
    text = ""
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


@pytest.fixture(scope="module")
def loop_server(tiny_llama_dir: Path, start_server: Callable[..., ServerProcess]) -> ServerProcess:
    return start_server(
        str(tiny_llama_dir), "--served-model-name", "tiny", "--chat-template", CHAT_TEMPLATE
    )


def test_health_and_metrics_answer_while_huge_prompts_are_tokenised(
    loop_server: ServerProcess,
) -> None:
    bodies = [huge_body(i) for i in range(NUM_HUGE)]
    flowing = {"model": "tiny", "prompt": words(20), "max_tokens": 300, "ignore_eos": True,
               "temperature": 0}
    reference = httpx.post(f"{loop_server.url}/v1/completions", json=flowing, timeout=60)
    assert reference.status_code == 200, reference.text
    alone = reference.json()["choices"][0]["text"]

    done = threading.Event()
    latencies: list[float] = []
    statuses: list[int] = []

    def poll() -> None:
        """Alternate /health and /metrics until every huge request has its answer; on a
        thread of its own, so the client loop busy sending 20 MB does not delay it."""
        with httpx.Client(base_url=loop_server.url, timeout=60) as client:
            while not done.is_set():
                for route in ("/health", "/metrics"):
                    started = time.perf_counter()
                    statuses.append(client.get(route).status_code)
                    latencies.append(time.perf_counter() - started)
                time.sleep(0.01)

    async def storm() -> tuple[list[httpx.Response], str]:
        limits = httpx.Limits(max_connections=NUM_HUGE + 8)
        async with httpx.AsyncClient(base_url=loop_server.url, timeout=300, limits=limits) as c:
            stream = asyncio.create_task(stream_text(c, flowing))
            posts = [
                c.post(
                    "/v1/chat/completions" if i % 2 else "/v1/completions",
                    content=body,
                    headers={"Content-Type": "application/json"},
                )
                for i, body in enumerate(bodies)
            ]
            return list(await asyncio.gather(*posts)), await stream

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        responses, streamed = asyncio.run(storm())
    finally:
        done.set()
        poller.join()
    assert set(statuses) == {200}
    for response in responses:  # refused for length, after being tokenised in full
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] in ("prompt", "messages")
        assert "maximum context length" in error["message"] or "tokens" in error["message"]
    assert streamed == alone  # the running stream kept flowing and was not disturbed
    # Tokenising one prompt takes ~0.4 s, 20 of them ~8 s: on the loop, most polls would
    # wait for one. Off it, a poll waits only for GIL turns. The median is the spec's
    # 100 ms; the max is looser (0.5 s) because a busy 2-core box can deschedule the
    # server process itself for a while, which no design of ours can prevent.
    median, worst = statistics.median(latencies), max(latencies)
    assert len(latencies) >= 20, latencies
    assert median < 0.1, (median, worst)
    assert worst < 0.5, (median, worst)
    assert loop_server.process.poll() is None


def test_abandoned_storm_is_aborted_before_it_is_computed(tiny_llama_dir: Path) -> None:
    server = InProcessServer(tiny_llama_dir, record_trace=True, max_num_batched_tokens=256)
    server.start()
    released = threading.Event()
    # Every step is held until the test has seen every client give up: whatever the
    # machine's speed, nothing abandoned can be computed unless the server fails to
    # abort it (then it would be prefilled as soon as the gate opens).
    gate = StepGate(server.engine, lambda live: not released.is_set(), max_hold_s=120)
    try:
        before = scrape_metrics(server.url)

        async def abandon(client: httpx.AsyncClient, index: int) -> bool:
            body = {"model": "tiny", "prompt": words(400, offset=index), "max_tokens": 16,
                    "request_id": f"abandoned-{index}"}
            try:
                await client.post("/v1/completions", json=body)
            except httpx.TimeoutException:
                return True
            return False

        async def storm() -> list[bool]:
            limits = httpx.Limits(max_connections=ABANDONED)
            async with httpx.AsyncClient(base_url=server.url, timeout=1.0, limits=limits) as c:
                return await asyncio.gather(*(abandon(c, i) for i in range(ABANDONED)))

        gave_up = asyncio.run(storm())
        assert all(gave_up)
        # Observable end of the abort: nothing waits or runs any more (deadline: a broken
        # server keeps them waiting forever).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            after = scrape_metrics(server.url)
            if after["inflight:num_requests_waiting"] == 0 and (
                after["inflight:num_requests_running"] == 0
            ):
                break
            time.sleep(0.05)
        assert after["inflight:num_requests_waiting"] == 0
        assert after["inflight:num_requests_running"] == 0
        aborted = abort_count(after) - abort_count(before)
        assert aborted >= 1  # they reached the engine and were aborted there
        released.set()
        started = time.monotonic()
        fresh = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": "tiny", "prompt": words(8), "max_tokens": 8, "request_id": "fresh"},
            timeout=30,
        )
        latency = time.monotonic() - started
    finally:
        gate.remove()
        server.stop()
    assert fresh.status_code == 200, fresh.text
    assert latency < 5.0  # nothing abandoned is left to compute before it
    assert gate.held.is_set() and not gate.gave_up
    trace = server.engine.step_trace.records
    prefilled = {e.request_id for record in trace for e in record.entries}
    assert any(r.startswith("cmpl-fresh-") for r in prefilled)
    assert not [r for r in prefilled if r.startswith("cmpl-abandoned-")]
    assert after["inflight:num_kv_blocks_used"] == 0
