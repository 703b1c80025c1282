"""Prefix caching over HTTP with the official openai client: cached tokens in ``usage``,
``cache_salt``, ``POST /reset_prefix_cache`` (409 while busy) and the metrics."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from server_harness import API_KEY, ServerProcess

PROMPT = list(range(5, 45))  # 40 tokens: 9 full blocks of 4 can be reused (not the last token)


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, start_server: Callable[..., ServerProcess]) -> ServerProcess:
    return start_server(str(tiny_llama_dir), "--api-key", API_KEY, "--block-size", "4")


def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def complete(server: ServerProcess, **extra: object):
    return client(server).completions.create(
        model="", prompt=PROMPT, max_tokens=6, temperature=0.0, extra_body=extra or None
    )


def reset(server: ServerProcess) -> httpx.Response:
    return httpx.post(
        f"{server.url}/reset_prefix_cache", headers={"Authorization": f"Bearer {API_KEY}"}
    )


def prefix_counters(server: ServerProcess) -> tuple[float, float]:
    text = httpx.get(f"{server.url}/metrics").text
    values = {
        s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
    }
    return values["inflight:prefix_cache_queries_total"], values["inflight:prefix_cache_hits_total"]


def test_second_request_reuses_the_prompt_and_answers_the_same(server: ServerProcess) -> None:
    assert reset(server).status_code == 200
    queries0, hits0 = prefix_counters(server)
    first = complete(server)
    second = complete(server)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 36
    assert second.choices[0].text == first.choices[0].text
    queries, hits = prefix_counters(server)
    assert (queries - queries0, hits - hits0) == (80, 36)


def test_cache_salt_keeps_tenants_apart(server: ServerProcess) -> None:
    complete(server, cache_salt="tenant-a")
    assert complete(server, cache_salt="tenant-b").usage.prompt_tokens_details.cached_tokens == 0
    assert complete(server, cache_salt="tenant-a").usage.prompt_tokens_details.cached_tokens == 36


def test_reset_empties_the_cache_and_refuses_while_busy(server: ServerProcess) -> None:
    complete(server)
    assert reset(server).status_code == 200
    assert complete(server).usage.prompt_tokens_details.cached_tokens == 0
    # A long stream holds blocks: the reset is refused until it is gone. (Its 470 steps
    # take far longer than the one round trip between its first chunk and the reset.)
    stream = client(server).completions.create(
        model="", prompt=PROMPT, max_tokens=470, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))  # its first token is out: it is running and holds blocks
    busy = reset(server)
    assert busy.status_code == 409
    assert "KV blocks" in busy.json()["error"]["message"]
    stream.close()
    assert complete(server).usage.prompt_tokens_details.cached_tokens == 36
    unauthorised = httpx.post(f"{server.url}/reset_prefix_cache")
    assert unauthorised.status_code == 401


def test_switched_off(tiny_llama_dir: Path, start_server: Callable[..., ServerProcess]) -> None:
    off = start_server(
        str(tiny_llama_dir), "--api-key", API_KEY, "--block-size", "4",
        "--no-enable-prefix-caching",
    )
    complete(off)
    assert complete(off).usage.prompt_tokens_details.cached_tokens == 0
    assert prefix_counters(off) == (0, 0)
