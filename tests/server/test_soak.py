"""Soak: many concurrent clients for a fixed time against a real server, then checks.

The tiny random model runs as ``inflight serve`` on a loopback port with a small KV cache
(preemption happens) and a small step budget (long prompts are chunked). Every case
(prompt x endpoint x greedy/seeded) is first run alone, one at a time, through the same
server; then 16 clients send a seeded mix of those cases, streaming or not, for
``SOAK_SECONDS``. Every answer during the storm must equal its case's run-alone answer:
greedy ones by definition, seeded ones because a seeded request draws from its own
generator (``worker/sampler.py``), whatever it is batched with or however often it is
preempted. Afterwards nothing runs or waits and every KV block is free. The requests
served and the P99 latency are written to the test log (and recorded as properties).

Deselect with ``-m "not soak"``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from server_harness import CHAT_TEMPLATE, ServerProcess, scrape_metrics

pytestmark = pytest.mark.soak

SOAK_SECONDS = 45.0
NUM_CLIENTS = 16
SEED = 2024


@dataclass(frozen=True)
class Case:
    prompt: str
    chat: bool
    seed: int | None  # None: greedy
    max_tokens: int

    @property
    def route(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def body(self, stream: bool) -> dict:
        body: dict = {"model": "tiny", "max_tokens": self.max_tokens, "stream": stream}
        if self.seed is None:
            body["temperature"] = 0
        else:
            body.update(temperature=1.0, top_p=0.9, seed=self.seed)
        if self.chat:
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        return body


def cases() -> list[Case]:
    rng = random.Random(SEED)
    prompts = [
        " ".join(f"w{rng.randrange(3, 512)}" for _ in range(rng.choice([4, 9, 180, 260])))
        for _ in range(10)
    ]
    return [
        Case(prompt, chat, seed, rng.choice([8, 24, 48]))
        for i, prompt in enumerate(prompts)
        for chat in (False, True)
        for seed in (None, 100 + i)
    ]


async def answer(client: httpx.AsyncClient, case: Case, stream: bool) -> str:
    if not stream:
        response = await client.post(case.route, json=case.body(False))
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return str(choice["message"]["content"] if case.chat else choice["text"])
    text = ""
    async with client.stream("POST", case.route, json=case.body(True)) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text += (choice["delta"].get("content") or "") if case.chat else choice["text"]
    return text


@pytest.fixture(scope="module")
def soak_server(tiny_llama_dir: Path, start_server: Callable[..., ServerProcess]) -> ServerProcess:
    return start_server(
        str(tiny_llama_dir), "--served-model-name", "tiny", "--chat-template", CHAT_TEMPLATE,
        "--max-num-seqs", "16", "--max-num-batched-tokens", "128", "--block-size", "16",
        "--num-kv-blocks", "48", "--max-model-len", "512",
    )


def test_soak(soak_server: ServerProcess, report_figure: Callable[[str], None],
              record_property: Callable[[str, object], None]) -> None:
    url = soak_server.url
    all_cases = cases()

    async def run() -> tuple[list[str], list[tuple[int, bool, str, float]]]:
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 4)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
            alone = [await answer(client, case, stream=False) for case in all_cases]
            served: list[tuple[int, bool, str, float]] = []
            end = time.monotonic() + SOAK_SECONDS

            async def worker(rng: random.Random) -> None:
                while time.monotonic() < end:
                    index = rng.randrange(len(all_cases))
                    stream = rng.random() < 0.5
                    started = time.monotonic()
                    text = await answer(client, all_cases[index], stream)
                    served.append((index, stream, text, time.monotonic() - started))

            await asyncio.gather(*(worker(random.Random(SEED + i)) for i in range(NUM_CLIENTS)))
            return alone, served

    before = scrape_metrics(url)
    alone, served = asyncio.run(run())
    deadline = time.monotonic() + 60
    while True:
        after = scrape_metrics(url)
        if (after["inflight:num_requests_running"], after["inflight:num_requests_waiting"],
                after["inflight:num_kv_blocks_used"]) == (0, 0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    wrong = [(all_cases[i], stream, text, alone[i])
             for i, stream, text, _ in served if text != alone[i]]
    assert not wrong, wrong[:3]
    assert len(served) >= NUM_CLIENTS
    assert {all_cases[i].seed is None for i, *_ in served} == {True, False}
    assert after["inflight:num_requests_running"] == 0
    assert after["inflight:num_requests_waiting"] == 0
    assert after["inflight:kv_cache_usage_perc"] == 0
    assert after["inflight:num_kv_blocks_used"] == 0  # every block is free
    preemptions = after["inflight:num_preemptions_total"] - before["inflight:num_preemptions_total"]
    assert preemptions > 0  # the small cache made the engine preempt and recompute
    latencies = sorted(latency for *_, latency in served)
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    record_property("requests_served", len(served))
    record_property("p99_latency_s", round(p99, 3))
    report_figure(
        f"soak: {len(served)} requests served in {SOAK_SECONDS:.0f} s by {NUM_CLIENTS} clients, "
        f"P99 latency {p99:.3f} s, {preemptions:.0f} preemptions, 0 mismatches, 0 blocks leaked"
    )
    assert soak_server.process.poll() is None
