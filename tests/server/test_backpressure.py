"""Backpressure and deadlines on the real app (in-process, so the engine can be held).

* ``max_waiting_requests``: with the limit reached a new request is refused at once with
  a 503 in OpenAI's error shape and a ``Retry-After`` header; the queued requests are
  served unchanged once the engine moves, and ``inflight:request_rejected_total`` counts
  the refusal.
* ``request_timeout``: a request past its deadline is aborted on the engine thread (its
  blocks freed) and answered 504, or its stream ends with an error event and ``[DONE]``;
  ``inflight:request_timeout_total`` counts it.

The engine is held with :class:`StepGate` (no request advances while it holds, commands
are still applied), and time is moved by replacing the async engine's clock, so no
outcome depends on the machine's speed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from inprocess_server import InProcessServer
from prometheus_client.parser import text_string_to_metric_families
from server_harness import CHAT_TEMPLATE

from helpers.step_gate import StepGate, once_all_have

PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [11, 12, 13, 14, 15]]


def completion(prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, **extra}


def counters(server: InProcessServer) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            extra = sample.labels.get("reason") or sample.labels.get("finished_reason")
            out[sample.name + (f":{extra}" if extra else "")] = sample.value
    return out


def wait_until(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Poll an observable state; the timeout only fails a server that never gets there."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the state was never reached"
        time.sleep(0.005)


def assert_openai_error(body: dict[str, Any]) -> dict[str, Any]:
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


def assert_engine_clean(server: InProcessServer) -> None:
    engine = server.engine
    wait_until(lambda: not engine.has_unfinished_requests())
    engine.scheduler.check_invariants()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[InProcessServer]:
    # One batch slot, so that a second request waits; at most 2 may wait.
    server = InProcessServer(tiny_llama_dir, max_num_seqs=1, max_waiting_requests=2).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def alone(server: InProcessServer) -> list[list[int]]:
    """Each prompt's greedy tokens, run alone through the same server."""
    out = []
    for prompt in PROMPTS:
        response = httpx.post(f"{server.url}/v1/completions",
                              json=completion(prompt, return_token_ids=True), timeout=60)
        assert response.status_code == 200, response.text
        out.append(response.json()["choices"][0]["token_ids"])
    return out


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as executor:
        yield executor


def post(pool: ThreadPoolExecutor, server: InProcessServer, body: dict[str, Any]) -> Future:
    return pool.submit(httpx.post, f"{server.url}/v1/completions", json=body, timeout=120)


# ---------------------------------------------------------------- backpressure


def test_full_queue_refuses_at_once_with_503_and_retry_after(
    server: InProcessServer, alone: list[list[int]], pool: ThreadPoolExecutor
) -> None:
    before = counters(server)
    gate = StepGate(server.engine, lambda live: True)  # nothing is scheduled: all wait
    try:
        queued = [post(pool, server, completion(p, return_token_ids=True)) for p in PROMPTS[:2]]
        wait_until(lambda: server.engine.scheduler.num_waiting == 2)
        refused = httpx.post(f"{server.url}/v1/completions", json=completion(PROMPTS[2]),
                             timeout=60)
        # The chat route goes through the same admission.
        chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "w5 w6"}],
            "max_tokens": 4, "chat_template": CHAT_TEMPLATE})
        assert server.engine.scheduler.num_waiting == 2  # the queue never grew past it
        assert not any(f.done() for f in queued)
    finally:
        gate.remove()
    for response in (refused, chat):
        assert response.status_code == 503, response.text
        error = assert_openai_error(response.json())
        assert error["type"] == "server_error" and error["code"] == "engine_overloaded"
        assert "max_waiting_requests is 2" in error["message"]
        assert "2 requests are waiting" in error["message"]
        assert int(response.headers["retry-after"]) >= 1
    # The queued requests are served unchanged once the engine moves.
    for future, expected in zip(queued, alone, strict=False):
        response = future.result()
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["token_ids"] == expected
    after = counters(server)
    assert after["inflight:request_rejected_total:queue_full"] == (
        before["inflight:request_rejected_total:queue_full"] + 2
    )
    # vLLM 0.32's name for the same count
    assert after["inflight:admission_rejections_total:max_num_queued_reqs"] == (
        before["inflight:admission_rejections_total:max_num_queued_reqs"] + 2
    )
    # Room again: a new request is accepted.
    again = httpx.post(f"{server.url}/v1/completions",
                       json=completion(PROMPTS[2], return_token_ids=True), timeout=60)
    assert again.status_code == 200 and again.json()["choices"][0]["token_ids"] == alone[2]
    assert_engine_clean(server)


# ---------------------------------------------------------------- deadlines


def move_clock(server: InProcessServer, seconds: float) -> None:
    """Make the engine thread see time ``seconds`` ahead from now on."""
    server.async_engine._clock = lambda: time.monotonic() + seconds


@pytest.fixture
def clock_reset(server: InProcessServer) -> Iterator[None]:
    yield
    server.async_engine._clock = time.monotonic


def test_waiting_request_past_its_deadline_gets_504_and_frees_everything(
    server: InProcessServer, alone: list[list[int]], pool: ThreadPoolExecutor,
    clock_reset: None,
) -> None:
    before = counters(server)
    gate = StepGate(server.engine, lambda live: True)
    try:
        doomed = post(pool, server, completion(PROMPTS[0], request_timeout=30))
        patient = post(pool, server, completion(PROMPTS[1], return_token_ids=True))
        wait_until(lambda: server.engine.scheduler.num_waiting == 2)
        move_clock(server, 31)  # past the first one's deadline only (the other has none)
        response = doomed.result(timeout=60)
        assert len(server.engine.scheduler.requests) == 1  # aborted before any step ran
    finally:
        gate.remove()
    assert response.status_code == 504, response.text
    error = assert_openai_error(response.json())
    assert error["code"] == "request_timeout" and error["param"] == "request_timeout"
    assert "timeout of 30 s" in error["message"]
    kept = patient.result(timeout=60)
    assert kept.status_code == 200 and kept.json()["choices"][0]["token_ids"] == alone[1]
    after = counters(server)
    assert after["inflight:request_timeout_total"] == before["inflight:request_timeout_total"] + 1
    assert after["inflight:request_success_total:abort"] == (
        before["inflight:request_success_total:abort"] + 1
    )
    assert_engine_clean(server)


def test_running_stream_past_its_deadline_ends_with_an_error_event(
    server: InProcessServer, clock_reset: None,
) -> None:
    body = completion(PROMPTS[2], stream=True, request_timeout=60, max_tokens=400)
    gate = StepGate(server.engine, once_all_have(3))  # decoding, holding 3 tokens' blocks
    try:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                          timeout=60) as response:
            assert response.status_code == 200
            lines = (line for line in response.iter_lines() if line.startswith("data:"))
            first = json.loads(next(lines).removeprefix("data: "))
            assert first["choices"][0]["text"]
            wait_until(gate.held.is_set)
            assert server.engine.kv_cache.num_free_blocks < server.engine.kv_cache.num_blocks
            move_clock(server, 61)
            rest = [line.removeprefix("data: ") for line in lines]
    finally:
        gate.remove()
    assert rest[-1] == "[DONE]"
    events = [json.loads(line) for line in rest[:-1]]
    error = assert_openai_error(events[-1])
    assert error["code"] == "request_timeout"
    assert all("choices" in e for e in events[:-1])
    assert_engine_clean(server)


def test_server_default_timeout_and_invalid_field(tiny_llama_dir: Path) -> None:
    """``--request-timeout`` applies to requests that set none; the field must be > 0."""
    server = InProcessServer(tiny_llama_dir, request_timeout=5.0).start()
    try:
        for bad in (0, -1, "soon"):
            response = httpx.post(f"{server.url}/v1/completions", timeout=60,
                                  json=completion(PROMPTS[0], request_timeout=bad))
            assert response.status_code == 400, response.text
            assert assert_openai_error(response.json())["param"] == "request_timeout"
        gate = StepGate(server.engine, lambda live: True)
        try:
            with ThreadPoolExecutor(1) as executor:
                pending = post(executor, server, completion(PROMPTS[0]))
                wait_until(lambda: server.engine.scheduler.num_waiting == 1)
                move_clock(server, 6)
                response = pending.result(timeout=60)
        finally:
            gate.remove()
        assert response.status_code == 504, response.text
        assert "timeout of 5 s" in response.json()["error"]["message"]
        assert_engine_clean(server)
    finally:
        server.stop()


# ---------------------------------------------------------------- offline


def test_offline_add_request_raises_at_the_limit_and_generate_feeds_as_room_frees(
    tiny_llama_dir: Path,
) -> None:
    from inflight import LLM, SamplingParams
    from inflight.engine.llm_engine import EngineOverloadedError

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": [i + 3, i + 9, i + 20]} for i in range(7)]
    reference = [o.outputs[0].token_ids
                 for o in LLM(str(tiny_llama_dir)).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(tiny_llama_dir), max_num_seqs=2, max_waiting_requests=2)
    engine = llm.llm_engine
    engine.add_request("a", prompts[0], params)
    engine.add_request("b", prompts[1], params)
    with pytest.raises(EngineOverloadedError, match="2 requests are waiting and "
                       "max_waiting_requests is 2"):
        engine.add_request("c", prompts[2], params)
    assert "c" not in engine.scheduler.requests and engine.scheduler.num_waiting == 2
    while engine.has_unfinished_requests():
        engine.step()
    # generate with more prompts than the limit: fed as room frees, never refused.
    waiting_seen: list[int] = []
    step = engine.step

    def watched_step() -> Any:
        waiting_seen.append(engine.scheduler.num_waiting)
        return step()

    engine.step = watched_step  # type: ignore[method-assign]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert max(waiting_seen) == 2  # the limit was reached and never passed


@pytest.mark.parametrize("timeout_s", [1e10, 1e300])
def test_a_huge_timeout_does_not_stop_the_engine(
    server: InProcessServer, alone: list[list[int]], timeout_s: float,
) -> None:
    """A deadline years away stays in the engine's heap after its request ends; the idle
    engine thread's wait for it must not overflow (it did past ~9.2e9 s and killed it)."""
    first = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json=completion(PROMPTS[0], request_timeout=timeout_s, return_token_ids=True))
    assert first.status_code == 200, first.text
    time.sleep(0.3)  # the engine thread goes idle, waiting for that deadline
    assert server.async_engine.is_healthy
    again = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json=completion(PROMPTS[1], return_token_ids=True))
    assert again.status_code == 200 and again.json()["choices"][0]["token_ids"] == alone[1]
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
