"""Fault storms: clients that vanish at random moments, and a client that never reads.

The storm runs on a real server (subprocess) with a small KV cache (preemption), a small
step budget (long prompts are prefilled in chunks) and few slots (requests wait):
streaming clients hang up after a seeded number of chunks (while decoding), and
non-streaming clients with long prompts give up after a seeded timeout (while waiting,
while their prompt is chunked, or while decoding, whichever their moment falls in).
Survivors run beside them. Afterwards the engine is healthy, logged no exception, every
KV block is free, and every survivor's greedy answer equals the same request run alone.

The slow consumer: a stream nobody reads must not hold up the engine or other streams,
and is dropped (aborted, blocks freed) once too much output waits undelivered.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from server_harness import CHAT_TEMPLATE, ServerProcess, abort_count, scrape_metrics, words

from inflight.engine.async_engine import AsyncLLMEngine
from inflight.engine.request_stream import StreamDroppedError, StreamLimits
from inflight.sampling_params import SamplingParams

SEED = 14
ENGINE_FAILURES = ("Traceback", "ERROR ", "engine step failed", "engine thread died")


def wait_idle(url: str, timeout_s: float = 60.0) -> dict[str, float]:
    """Scrape until nothing runs, waits or holds a block (the deadline only fails a leak)."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape_metrics(url)
        idle = (
            samples["inflight:num_requests_running"] == 0
            and samples["inflight:num_requests_waiting"] == 0
            and samples["inflight:num_kv_blocks_used"] == 0
        )
        if idle or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


def assert_idle(samples: dict[str, float]) -> None:
    assert samples["inflight:num_requests_running"] == 0
    assert samples["inflight:num_requests_waiting"] == 0
    assert samples["inflight:num_kv_blocks_used"] == 0  # no block leaked
    assert samples["inflight:kv_cache_usage_perc"] == 0


def request_body(index: int, stream: bool) -> tuple[str, dict]:
    """A greedy survivor: chat or completion, short or long prompt, up to 120 tokens."""
    prompt = words(40 + 60 * (index % 4), offset=index, stride=11)
    body: dict = {"model": "tiny", "max_tokens": 60 + 20 * (index % 4), "temperature": 0,
                  "stream": stream}
    if index % 2:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


async def answer(client: httpx.AsyncClient, route: str, body: dict) -> str:
    """The whole answer's text, streamed or not."""
    chat = route.endswith("chat/completions")
    if not body.get("stream"):
        response = await client.post(route, json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return str(choice["message"]["content"] if chat else choice["text"])
    text = ""
    async with client.stream("POST", route, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text += (choice["delta"].get("content") or "") if chat else choice["text"]
    return text


async def hang_up_mid_stream(client: httpx.AsyncClient, index: int, chunks: int) -> None:
    body = {"model": "tiny", "prompt": words(30, offset=index, stride=11), "max_tokens": 250,
            "ignore_eos": True, "temperature": 0, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        seen = 0
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen >= chunks:
                    break  # leaving the block closes the connection mid-stream


async def give_up(url: str, index: int, timeout_s: float) -> None:
    body = {"model": "tiny", "prompt": words(300, offset=index, stride=11), "max_tokens": 200,
            "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as client:
        try:
            await client.post("/v1/completions", json=body)
        except httpx.TimeoutException:
            pass


@pytest.fixture(scope="module")
def storm_server(tiny_llama_dir: Path, start_server: Callable[..., ServerProcess]) -> ServerProcess:
    return start_server(
        str(tiny_llama_dir), "--served-model-name", "tiny", "--chat-template", CHAT_TEMPLATE,
        "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--block-size", "16",
        "--num-kv-blocks", "40", "--max-model-len", "512",
    )


def test_disconnect_and_abort_storm(
    storm_server: ServerProcess, report_figure: Callable[[str], None]
) -> None:
    url = storm_server.url
    rng = random.Random(SEED)
    survivors = [request_body(i, stream=bool(i % 3)) for i in range(12)]

    async def references() -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return [await answer(client, r, {**b, "stream": False}) for r, b in survivors]

    alone = asyncio.run(references())
    before = scrape_metrics(url)
    hang_ups = [rng.randint(1, 40) for _ in range(24)]
    timeouts = [rng.uniform(0.05, 2.0) for _ in range(16)]

    async def storm() -> list[str]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
            faults = [hang_up_mid_stream(client, i, k) for i, k in enumerate(hang_ups)]
            faults += [give_up(url, i, t) for i, t in enumerate(timeouts)]
            answers = asyncio.gather(*(answer(client, r, b) for r, b in survivors))
            _, texts = await asyncio.gather(asyncio.gather(*faults), answers)
            return list(texts)

    texts = asyncio.run(storm())
    after = wait_idle(url)
    assert texts == alone  # survivors never see another request's state
    assert_idle(after)
    # Every hung-up stream asked for 250 tokens and left after at most 40 chunks.
    assert abort_count(after) - abort_count(before) >= len(hang_ups)
    preemptions = after["inflight:num_preemptions_total"] - before["inflight:num_preemptions_total"]
    assert preemptions > 0
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    report_figure(
        f"fault storm: {len(hang_ups)} mid-stream hang-ups and {len(timeouts)} client "
        f"give-ups survived ({abort_count(after) - abort_count(before):.0f} aborts, "
        f"{preemptions:.0f} preemptions), {len(survivors)} survivors correct, 0 blocks leaked"
    )
    log = storm_server.log()
    assert not [marker for marker in ENGINE_FAILURES if marker in log], log[-4000:]
    # Still serving, and still right.
    route, body = survivors[0]

    async def again() -> str:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await answer(client, route, body)

    assert asyncio.run(again()) == alone[0]


def test_unread_stream_is_dropped_while_others_flow(tiny_llama_dir: Path) -> None:
    """At the stream level, with a small bound: the reader never reads one stream."""

    async def run() -> None:
        engine = AsyncLLMEngine.from_options(str(tiny_llama_dir))
        # Small against the stalled request's 400 tokens, but with room for a reader that
        # reads on a loaded machine (at 8, "alone" itself was once dropped under load).
        engine.stream_limits = StreamLimits(max_undelivered_deltas=32)
        engine.start()
        try:
            greedy = SamplingParams(max_tokens=40, temperature=0.0)
            prompt = {"prompt": words(12, stride=11)}
            alone = [d.text async for d in engine.generate("alone", prompt, greedy)]
            long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
            stalled = await engine.add_request("stalled", {"prompt": words(20, stride=11)}, long)
            # The other stream flows to its end while the stalled one is never read.
            beside = [d.text async for d in engine.generate("beside", prompt, greedy)]
            assert "".join(beside) == "".join(alone)
            deadline = time.monotonic() + 60
            while not stalled.dropped and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert stalled.dropped
            with pytest.raises(StreamDroppedError):
                async for _ in stalled:
                    pass
            while engine.stats.num_requests_running and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            stats = engine.stats
            assert stats.num_requests_running == 0 and stats.num_kv_blocks_used == 0
            assert dict(stats.request_success).get("abort", 0) == 1
            # Dropped early: far fewer than the 400 tokens it asked for were made.
            assert stats.generation_tokens_total < 40 + 40 + 400
        finally:
            await engine.shutdown()

    asyncio.run(run())


@pytest.fixture(scope="module")
def wide_server(tiny_llama_dir: Path, start_server: Callable[..., ServerProcess]) -> ServerProcess:
    return start_server(
        str(tiny_llama_dir), "--served-model-name", "tiny", "--chat-template", CHAT_TEMPLATE,
        "--max-num-seqs", "136",
    )


def test_client_that_never_reads_is_dropped(wide_server: ServerProcess) -> None:
    """Over HTTP, with the server's default bound: a raw socket sends a request whose
    answer (128 choices x 300 tokens, ~7 MB of events) is far larger than what the TCP
    buffers hold, and never reads a byte. Other requests are served meanwhile; the
    stalled one is aborted and its blocks freed while its socket is still open."""
    url = wide_server.url
    greedy = {"model": "tiny", "prompt": words(16, stride=11), "max_tokens": 32, "temperature": 0}
    alone = httpx.post(f"{url}/v1/completions", json=greedy, timeout=60).json()
    before = scrape_metrics(url)
    body = json.dumps({
        "model": "tiny", "messages": [{"role": "user", "content": words(10, stride=11)}], "n": 128,
        "max_tokens": 300, "ignore_eos": True, "stream": True, "temperature": 1.0, "seed": 3,
    }).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.socket() as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting
        client.connect(("127.0.0.1", wide_server.port))
        client.sendall(head + body)
        # The stalled request is running: other requests are still answered, correctly.
        deadline = time.monotonic() + 120
        while scrape_metrics(url)["inflight:num_requests_running"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        for _ in range(3):
            during = httpx.post(f"{url}/v1/completions", json=greedy, timeout=60).json()
            assert during["choices"][0]["text"] == alone["choices"][0]["text"]
        after = wait_idle(url, timeout_s=120)
        assert_idle(after)  # dropped while the client still holds its socket open
        assert abort_count(after) - abort_count(before) == 1
    made = after["inflight:generation_tokens_total"] - before["inflight:generation_tokens_total"]
    assert made < 128 * 300  # aborted before the end
    assert "dropping request chatcmpl-" in wide_server.log()
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
