"""Data-parallel scaling: throughput with 1 and 2 Ray replicas, and the router's cost.

``python -m inflight.bench.dp_scaling [--model M] [--num-prompts 16] [--max-tokens 32]``
prints one row per replica count (requests/s, output tokens/s, speed-up over one replica)
and the driver's cost per request, for a paper estimate of how far one router scales:

* ``router µs/request``: :class:`Router` alone (choose with prefix-affinity hashing,
  begin, progress, end) on synthetic 512-token prompts;
* ``driver CPU µs/request``: the serving process's CPU time per request in the real run
  (routing, Ray submission, receiving every delta), which is what actually bounds it.

One driver process feeds at most ``1e6 / driver_us`` requests/s, so it can keep about
``(1e6 / driver_us) / r1`` replicas busy, where ``r1`` is one replica's request rate.
Replicas on one machine share its cores: on a 2-core machine two replicas of one torch
thread each gain little over one replica of two threads.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass

from inflight.bench.cli_types import int_at_least
from inflight.distributed.router import Router, RouterConfig
from inflight.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ScalingRow:
    replicas: int
    seconds: float
    num_requests: int
    output_tokens: int
    driver_cpu_us_per_request: float

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def router_overhead_us(num_requests: int = 5000, prompt_len: int = 512, seed: int = 0) -> float:
    """Mean microseconds of routing one request (choose + begin + 8 progress + end)."""
    rng = random.Random(seed)
    router = Router(RouterConfig(num_replicas=8, block_size=16))
    prefixes = [[rng.randrange(32000) for _ in range(128)] for _ in range(32)]
    prompts = [
        rng.choice(prefixes) + [rng.randrange(32000) for _ in range(prompt_len - 128)]
        for _ in range(256)
    ]
    started = time.perf_counter()
    for i in range(num_requests):
        prompt = prompts[i % len(prompts)]
        request_id = f"r{i}"
        router.begin(request_id, router.choose(prompt).replica, len(prompt), 64)
        for _ in range(8):
            router.progress(request_id, 8)
        router.end(request_id)
    return (time.perf_counter() - started) / num_requests * 1e6


def _prompts(num: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ["the", "a", "model", "serves", "requests", "on", "many", "machines", "fast", "and"]
    return [" ".join(rng.choice(words) for _ in range(24)) for _ in range(num)]


async def _run(client: object, prompts: list[str], max_tokens: int) -> int:
    from inflight.distributed.client import DataParallelEngineClient

    assert isinstance(client, DataParallelEngineClient)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

    async def one(i: int, prompt: str) -> int:
        stream = await client.add_request(f"bench-{i}", prompt, params)
        tokens = 0
        async for delta in stream:
            tokens += len(delta.token_ids)
        return tokens

    return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def measure(model: str | None, replicas: int, prompts: list[str], max_tokens: int) -> ScalingRow:
    from inflight.distributed.client import DataParallelConfig, DataParallelEngineClient

    client = DataParallelEngineClient(model, {}, DataParallelConfig(data_parallel_size=replicas))

    async def main() -> ScalingRow:
        client.start()
        await _run(client, prompts[:replicas], 4)  # warm-up: every replica's first step
        cpu, wall = time.process_time(), time.perf_counter()
        tokens = await _run(client, prompts, max_tokens)
        seconds = time.perf_counter() - wall
        cpu_us = (time.process_time() - cpu) / len(prompts) * 1e6
        await client.shutdown()
        return ScalingRow(replicas, seconds, len(prompts), tokens, cpu_us)

    return asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inflight.bench.dp_scaling")
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--num-prompts", type=int_at_least(1), default=16)
    parser.add_argument("--max-tokens", type=int_at_least(1), default=32)
    parser.add_argument("--replicas", type=int_at_least(1), nargs="+", default=[1, 2])
    args = parser.parse_args(argv)
    prompts = _prompts(args.num_prompts, seed=0)
    try:
        rows = [measure(args.model, n, prompts, args.max_tokens) for n in args.replicas]
    except (RuntimeError, ValueError) as error:  # no Ray; every replica dead (e.g. OOM)
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 1
    base = rows[0].tokens_per_s
    print("| replicas | requests/s | output tok/s | speed-up | driver CPU µs/request |")
    print("|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row.replicas} | {row.requests_per_s:.2f} | {row.tokens_per_s:.1f} | "
            f"{row.tokens_per_s / base:.2f}x | {row.driver_cpu_us_per_request:.0f} |"
        )
    router_us = router_overhead_us()
    driver_us = max(row.driver_cpu_us_per_request for row in rows)
    one_replica_rps = rows[0].requests_per_s / rows[0].replicas
    print(f"\nrouter alone: {router_us:.1f} µs/request (512-token prompts, affinity on)")
    print(
        f"paper estimate: one driver feeds ~{1e6 / driver_us:.0f} requests/s, i.e. "
        f"~{1e6 / driver_us / one_replica_rps:.0f} replicas at {one_replica_rps:.2f} "
        "requests/s each (this workload); the router's own share caps it at "
        f"~{1e6 / router_us:.0f} requests/s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
