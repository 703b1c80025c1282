"""``inflight serve`` with no MODEL: SmolLM2-135M-Instruct and its own chat template."""

from __future__ import annotations

from collections.abc import Callable

import openai
from server_harness import ServerProcess


def test_default_model_chat(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server("--max-num-seqs", "4")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    response = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=messages,
        max_tokens=16,
        temperature=0,  # type: ignore[arg-type]
    )
    answer = response.choices[0].message.content or ""
    assert "Paris" in answer, answer
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=messages,
        max_tokens=16,
        temperature=0,  # type: ignore[arg-type]
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == answer
