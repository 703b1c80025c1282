"""``GET /metrics``: Prometheus text that parses, and that tracks the engine's state."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families
from server_harness import API_KEY, ServerProcess

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def scrape(server: ServerProcess) -> dict[str, float]:
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
    after = scrape(tiny_server)
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


def test_aborted_stream_frees_its_blocks(tiny_server: ServerProcess) -> None:
    aborts = "inflight:request_success_total[('finished_reason', 'abort')]"
    before = scrape(tiny_server)
    body = {
        "model": "tiny",
        "prompt": "w3 w4 w5",
        "max_tokens": 480,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{tiny_server.url}/v1/completions", json=body, headers=AUTH
    ) as response:
        lines = response.iter_lines()
        for _ in range(3):
            assert next(line for line in lines if line.startswith("data:"))
        during = scrape(tiny_server)
        assert during["inflight:num_requests_running"] == 1
        assert during["inflight:num_kv_blocks_used"] >= 1
        assert during["inflight:kv_cache_usage_perc"] > 0
    # Leaving the block closes the connection mid-stream: the request must be aborted,
    # not run to its 480 tokens, and its blocks go back to the pool.
    deadline = time.monotonic() + 10
    while True:
        after = scrape(tiny_server)
        if after[aborts] == before[aborts] + 1 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert after[aborts] == before[aborts] + 1
    assert after["inflight:num_requests_running"] == 0
    assert after["inflight:num_kv_blocks_used"] == 0
    assert after["inflight:kv_cache_usage_perc"] == 0
    assert (
        after["inflight:generation_tokens_total"] - before["inflight:generation_tokens_total"] < 480
    )


def test_aborted_non_streaming_request_frees_its_blocks(tiny_server: ServerProcess) -> None:
    aborts = "inflight:request_success_total[('finished_reason', 'abort')]"
    before = scrape(tiny_server)
    body = {
        "model": "tiny",
        "prompt": "w3 w4 w5",
        "max_tokens": 480,
        "temperature": 0,
        "ignore_eos": True,
    }
    try:
        httpx.post(f"{tiny_server.url}/v1/completions", json=body, headers=AUTH, timeout=0.3)
    except httpx.TimeoutException:
        pass  # the client gave up and closed the connection
    deadline = time.monotonic() + 10
    while scrape(tiny_server)[aborts] == before[aborts] and time.monotonic() < deadline:
        time.sleep(0.05)
    after = scrape(tiny_server)
    assert after[aborts] == before[aborts] + 1
    assert after["inflight:num_kv_blocks_used"] == 0
