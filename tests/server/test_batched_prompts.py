"""A completions request with a list of prompts runs them as one batch.

(A user's report: 64 prompts in one request took 75 engine steps where 64 concurrent
requests took 6, because each prompt's admission waited for the next step; with
`n` large, the first prompts' output then piled up unread until the server dropped the
request's own streams and answered 500.) Expected tokens come from the same prompts sent
one per request to the same server.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from inprocess_server import InProcessServer

from inflight.engine.request_stream import StreamLimits

PROMPTS = [[3 + (i * 7 + j) % 400 for j in range(4 + i % 5)] for i in range(48)]


def body(prompt: Any, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True, **extra,
    }


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[InProcessServer]:
    server = InProcessServer(tiny_llama_dir, max_num_seqs=64).start()
    yield server
    server.stop()


def test_a_request_s_prompts_are_admitted_in_one_step(server: InProcessServer) -> None:
    alone = []
    for prompt in PROMPTS:
        response = httpx.post(f"{server.url}/v1/completions", json=body(prompt), timeout=60)
        assert response.status_code == 200, response.text
        alone.append(response.json()["choices"][0]["token_ids"])
    timings = server.engine.timings
    before = timings.num_steps
    response = httpx.post(f"{server.url}/v1/completions", json=body(PROMPTS), timeout=120)
    assert response.status_code == 200, response.text
    steps = timings.num_steps - before
    # 48 short prompts fit one step's token budget: one prefill step (which samples each
    # prompt's first token) and two decode steps; admitted one per step they took 50.
    assert steps <= 5, steps
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == list(range(len(PROMPTS)))
    assert [c["token_ids"] for c in choices] == alone


def test_many_prompts_times_n_are_read_as_they_run_not_dropped(server: InProcessServer) -> None:
    """Each prompt's stream may hold 256 unread deltas here (4096 by default); 24 prompts
    with n=16 make 320 each. Read as they run, none is dropped, streamed or not (admitted
    one per step, the first prompts overflowed while the last waited: a 500, or a
    stream_dropped error event)."""
    engine = server.async_engine
    default = engine.stream_limits
    engine.stream_limits = StreamLimits(max_undelivered_deltas=256)
    try:
        prompts = PROMPTS[:24]
        extra = {"n": 16, "max_tokens": 20, "temperature": 1.0, "seed": 5}
        whole = httpx.post(
            f"{server.url}/v1/completions", json=body(prompts, **extra), timeout=300
        )
        assert whole.status_code == 200, whole.text
        choices = whole.json()["choices"]
        assert len(choices) == 24 * 16
        assert all(len(c["token_ids"]) == 20 for c in choices)
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json=body(prompts, stream=True, **extra),
            timeout=300,
        ) as streamed:
            text = "".join(streamed.iter_text())
        assert '"error"' not in text and text.rstrip().endswith("data: [DONE]")
    finally:
        engine.stream_limits = default
    assert not server.engine.has_unfinished_requests()
