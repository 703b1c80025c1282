"""``GET /metrics``: Prometheus text that parses, and that tracks the engine's state."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from inprocess_server import InProcessServer
from prometheus_client.parser import text_string_to_metric_families
from server_harness import API_KEY, ServerProcess

from helpers.step_gate import StepGate, once_all_have

AUTH = {"Authorization": f"Bearer {API_KEY}"}


ABORTS = "inflight:request_success_total[('finished_reason', 'abort')]"
# As many tokens as the tiny model's 512 positions allow after the 3-token prompt.
LONG = 509


def scrape(server: ServerProcess | InProcessServer) -> dict[str, float]:
    """Every sample as ``name{label=...}`` -> value, model_name label left out."""
    response = httpx.get(f"{server.url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k not in ("model_name", "engine")}
            key = sample.name + ("" if not labels else str(sorted(labels.items())))
            samples[key] = sample.value
    return samples


def test_metrics_parse_and_count(tiny_server: ServerProcess) -> None:
    before = scrape(tiny_server)
    for name in (
        "inflight:num_requests_running",
        "inflight:num_requests_waiting",
        "inflight:kv_cache_usage_perc",
        "inflight:num_preemptions_total",
        "inflight:prompt_tokens_total",
        "inflight:generation_tokens_total",
        "inflight:time_to_first_token_seconds_count",
        "inflight:time_per_output_token_seconds_count",
        "inflight:e2e_request_latency_seconds_count",
    ):
        assert name in before, name
    body = {
        "model": "tiny",
        "prompt": "w3 w4 w5",
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
    }
    assert (
        httpx.post(f"{tiny_server.url}/v1/completions", json=body, headers=AUTH).status_code == 200
    )
    # The reply can reach us a moment before the engine thread publishes its last stats.
    e2e = "inflight:e2e_request_latency_seconds_count"
    after = wait_for(
        tiny_server,
        lambda s: s[e2e] > before[e2e] and s["inflight:num_requests_running"] == 0,
    )
    assert after["inflight:prompt_tokens_total"] - before["inflight:prompt_tokens_total"] == 3
    generated = (
        after["inflight:generation_tokens_total"] - before["inflight:generation_tokens_total"]
    )
    assert generated == 6
    for histogram, observations in (
        ("time_to_first_token_seconds", 1),
        ("time_per_output_token_seconds", 5),  # one per gap between the 6 tokens, as vLLM
        ("e2e_request_latency_seconds", 1),
    ):
        name = f"inflight:{histogram}_count"
        assert after[name] == before[name] + observations
        assert f"inflight:{histogram}_bucket[('le', '+Inf')]" in after
    assert after["inflight:num_requests_running"] == 0
    assert after["inflight:kv_cache_usage_perc"] == 0


@pytest.fixture(scope="module")
def gated_server(tiny_llama_dir: Path) -> Iterator[InProcessServer]:
    """A server whose engine a test can hold (see helpers.step_gate)."""
    server = InProcessServer(tiny_llama_dir, api_key=API_KEY).start()
    yield server
    server.stop()


def wait_for(
    server: ServerProcess | InProcessServer,
    done: Callable[[dict[str, float]], bool],
    timeout_s: float = 60.0,
) -> dict[str, float]:
    """Scrape until ``done`` holds; the deadline only fails a server that never gets there."""
    deadline = time.monotonic() + timeout_s
    while not done(samples := scrape(server)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return samples


def long_completion(stream: bool) -> dict:
    return {
        "model": "tiny",
        "prompt": "w3 w4 w5",
        "max_tokens": LONG,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def test_aborted_stream_frees_its_blocks(gated_server: InProcessServer) -> None:
    before = scrape(gated_server)
    # After 3 tokens the engine makes no progress until the request leaves the scheduler.
    gate = StepGate(gated_server.engine, once_all_have(3))
    try:
        with httpx.stream(
            "POST", f"{gated_server.url}/v1/completions", json=long_completion(True), headers=AUTH
        ) as response:
            lines = response.iter_lines()
            for _ in range(3):
                assert next(line for line in lines if line.startswith("data:"))
            during = scrape(gated_server)
            assert during["inflight:num_requests_running"] == 1
            assert during["inflight:num_kv_blocks_used"] >= 1
            assert during["inflight:kv_cache_usage_perc"] > 0
        # Leaving the block closes the connection mid-stream: the request must be aborted,
        # not run to its end, and its blocks go back to the pool.
        after = wait_for(gated_server, lambda s: s[ABORTS] == before[ABORTS] + 1)
    finally:
        gate.remove()
    assert gate.held.is_set() and not gate.gave_up, "the disconnect never aborted the request"
    assert after[ABORTS] == before[ABORTS] + 1
    assert after["inflight:num_requests_running"] == 0
    assert after["inflight:num_kv_blocks_used"] == 0
    assert after["inflight:kv_cache_usage_perc"] == 0
    generated = (
        after["inflight:generation_tokens_total"] - before["inflight:generation_tokens_total"]
    )
    assert 3 <= generated < LONG


def test_aborted_non_streaming_request_frees_its_blocks(gated_server: InProcessServer) -> None:
    before = scrape(gated_server)
    gate = StepGate(gated_server.engine, once_all_have(3))
    body = json.dumps(long_completion(False)).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    try:
        with socket.create_connection(("127.0.0.1", gated_server.port)) as client:
            client.sendall(head + body)
            # Observable: the request runs and has made its tokens (then the gate holds it).
            during = wait_for(
                gated_server,
                lambda s: (
                    s["inflight:num_requests_running"] == 1
                    and s["inflight:generation_tokens_total"]
                    >= before["inflight:generation_tokens_total"] + 3
                ),
            )
            assert during["inflight:num_requests_running"] == 1
            assert during["inflight:num_kv_blocks_used"] >= 1
        # The client has hung up before any reply: the server must abort the request.
        after = wait_for(gated_server, lambda s: s[ABORTS] == before[ABORTS] + 1)
    finally:
        gate.remove()
    assert gate.held.is_set() and not gate.gave_up, "the disconnect never aborted the request"
    assert after[ABORTS] == before[ABORTS] + 1
    assert after["inflight:num_requests_running"] == 0
    assert after["inflight:num_kv_blocks_used"] == 0
    generated = (
        after["inflight:generation_tokens_total"] - before["inflight:generation_tokens_total"]
    )
    assert 3 <= generated < LONG
