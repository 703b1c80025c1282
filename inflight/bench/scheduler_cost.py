"""What the prefix cache's bookkeeping costs the step loop: ``python -m inflight.bench.scheduler_cost``.

Runs the real :class:`~inflight.core.scheduler.Scheduler` and
:class:`~inflight.core.kv_cache_manager.KVCacheManager` (pure Python, no model) with a
fake runner that answers every sampling request with one token, on a shared-prefix
stream of requests that keeps ``max_num_seqs`` (default 256) requests running: all are
queued at once, and each finished request's slot goes to the next waiting one, whose
system prompt is a prefix-cache hit. It times ``schedule()`` + ``update_from_output()``
per step (process CPU time, so other load on the machine does not count) over the
steady-state steps (every slot busy), with prefix caching on and then
off, and prints ms per step for each and the difference: the hit path's cost (hashing
newly full blocks, lookups on admission, reference counts, LRU upkeep).

The numbers are host time on whatever machine runs it; the model is not involved.

``--prefill-counts`` instead counts, for the named prefix-caching workloads in full, the
prefill tokens the engine computes with caching on and off: which blocks hit depends
only on the scheduler, the cache geometry and token *equality* (a multi-turn history is
the previous prompt plus the previous answer, whatever its tokens), so the real core with
a fake model gives the counts a model run with the same settings gives, in seconds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

from inflight.bench import workloads
from inflight.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, SchedulerConfig
from inflight.core.interface import ModelRunnerOutput, SchedulerOutput
from inflight.core.kv_cache_manager import KVCacheManager
from inflight.core.request import Request
from inflight.core.scheduler import Scheduler
from inflight.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class CostResult:
    enable_prefix_caching: bool
    num_steps: int  # steady-state steps measured
    mean_ms: float
    p50_ms: float
    p99_ms: float
    num_cached_tokens: int
    # The same steps split: those that admitted requests (prefix lookups, hashing whole
    # prompts) and pure decode steps (hashing a block now and then).
    admit_mean_ms: float
    decode_mean_ms: float


def fake_runner(output: SchedulerOutput) -> ModelRunnerOutput:
    """One deterministic token per sampling request; the model's time is not measured."""
    return ModelRunnerOutput(
        {s.request_id: 1000 + s.num_tokens for s in output.scheduled if s.sample}
    )


def make_requests(num_requests: int, prefix_len: int, seed: int = 0) -> list[Request]:
    """Requests sharing a ``prefix_len``-token system prompt, then 16..128 distinct tokens,
    generating 32..128 tokens (EOS ignored): the shared-prefix workload's shape."""
    rng = random.Random(seed)
    system = [rng.randrange(1000, 49000) for _ in range(prefix_len)]
    requests = []
    for i in range(num_requests):
        suffix = [rng.randrange(1000, 49000) for _ in range(rng.randint(16, 128))]
        params = SamplingParams(temperature=0.0, max_tokens=rng.randint(32, 128), ignore_eos=True)
        requests.append(Request(str(i), system + suffix, params))
    return requests


def measure(
    enable_prefix_caching: bool,
    max_num_seqs: int = 256,
    num_requests: int = 1024,
    prefix_len: int = 512,
    block_size: int = 16,
) -> CostResult:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=8192, max_model_len=4096
    )
    blocks_per_request = (prefix_len + 128 + 128) // block_size + 1
    kv_cache = KVCacheManager(
        max_num_seqs * blocks_per_request + 64, block_size, enable_prefix_caching
    )
    scheduler = Scheduler(config, kv_cache)
    for request in make_requests(num_requests, prefix_len):
        scheduler.add_request(request)
    step_ms: list[float] = []
    admit_ms: list[float] = []
    decode_ms: list[float] = []
    cached = 0
    while scheduler.has_unfinished_requests():
        # CPU time of this process: on a shared machine, time spent descheduled would
        # swamp the difference being measured.
        started = time.process_time()
        output = scheduler.schedule()
        runner_output = fake_runner(output)  # a few µs; kept inside so the loop is whole
        scheduler.update_from_output(output, runner_output)
        elapsed = time.process_time() - started
        cached += sum(s.num_cached_tokens for s in output.scheduled)
        # Steady state: every slot busy and requests still waiting to be admitted.
        if len(output.scheduled) == max_num_seqs and scheduler.num_waiting:
            step_ms.append(elapsed * 1e3)
            admits = any(s.is_prefill for s in output.scheduled)
            (admit_ms if admits else decode_ms).append(elapsed * 1e3)
    ordered = sorted(step_ms)
    return CostResult(
        enable_prefix_caching,
        len(step_ms),
        statistics.fmean(step_ms),
        ordered[len(ordered) // 2],
        ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        cached,
        statistics.fmean(admit_ms) if admit_ms else 0.0,
        statistics.fmean(decode_ms) if decode_ms else 0.0,
    )


@dataclass(frozen=True, slots=True)
class PrefillCount:
    num_prompt_tokens: int
    num_prefill_tokens_computed: int
    num_cached_tokens: int


def count_prefill(
    workload: workloads.Workload,
    enable_prefix_caching: bool,
    num_blocks: int = 5825,  # the default model's 2 GiB of bf16 KV cache
    block_size: int = 16,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
) -> PrefillCount:
    """Run ``workload`` as ``bench throughput`` does (dependent turns added after their
    predecessor finished) through the real scheduler and a fake model."""
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
    )
    scheduler = Scheduler(config, KVCacheManager(num_blocks, block_size, enable_prefix_caching))
    workloads.full_prompt_lens(workload.requests)  # every dependency points back
    by_id = {r.id: r for r in workload.requests}
    waiting_on: dict[int, list[workloads.WorkloadRequest]] = {}
    live: dict[str, Request] = {}
    prompt_tokens = computed = cached = 0

    def add(item: workloads.WorkloadRequest, prompt: list[int]) -> None:
        nonlocal prompt_tokens
        params = SamplingParams(temperature=0.0, max_tokens=item.max_tokens, ignore_eos=True)
        request = Request(str(item.id), prompt, params)
        live[request.request_id] = request
        prompt_tokens += len(prompt)
        scheduler.add_request(request)

    for item in workload.requests:
        if item.after is None:
            add(item, list(item.prompt_token_ids))
        else:
            waiting_on.setdefault(item.after, []).append(item)
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        computed += sum(s.num_tokens for s in output.scheduled if s.is_prefill)
        cached += sum(s.num_cached_tokens for s in output.scheduled)
        for update in scheduler.update_from_output(output, fake_runner(output)):
            if not update.finished:
                continue
            done = live.pop(update.request_id)
            for turn in waiting_on.pop(int(update.request_id), []):
                history = workloads.full_prompt(
                    by_id[turn.id], done.prompt_token_ids, done.output_token_ids
                )
                add(turn, history)
    return PrefillCount(prompt_tokens, computed, cached)


def print_prefill_counts() -> None:
    for name in ("shared-prefix", "multi-turn"):
        workload = workloads.named(name)
        on, off = count_prefill(workload, True), count_prefill(workload, False)
        print(
            f"{name} ({len(workload.requests)} requests, {on.num_prompt_tokens} prompt tokens): "
            f"{on.num_prefill_tokens_computed} prefill tokens computed with caching, "
            f"{off.num_prefill_tokens_computed} without "
            f"({off.num_prefill_tokens_computed / on.num_prefill_tokens_computed:.2f}x less), "
            f"{on.num_cached_tokens / on.num_prompt_tokens:.1%} of prompt tokens cached"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m inflight.bench.scheduler_cost",
        description="Scheduler step cost with prefix caching on vs off (no model).",
    )
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--num-requests", type=int, default=1024)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3, help="best of N runs per setting")
    parser.add_argument(
        "--prefill-counts",
        action="store_true",
        help="instead: prefill tokens computed on the full shared-prefix and multi-turn "
        "workloads, caching on vs off (engine defaults, the default model's KV cache)",
    )
    args = parser.parse_args(argv)
    if args.prefill_counts:
        print_prefill_counts()
        return 0
    best: dict[bool, CostResult] = {}
    for _ in range(args.repeats):
        for caching in (True, False):
            result = measure(caching, args.max_num_seqs, args.num_requests, args.prefix_len)
            if caching not in best or result.mean_ms < best[caching].mean_ms:
                best[caching] = result
    for caching in (True, False):
        r = best[caching]
        print(
            f"prefix caching {'on ' if caching else 'off'}: {r.mean_ms:.3f} ms/step mean, "
            f"{r.p50_ms:.3f} p50, {r.p99_ms:.3f} p99 over {r.num_steps} steps at "
            f"{args.max_num_seqs} running ({r.admit_mean_ms:.3f} admitting, "
            f"{r.decode_mean_ms:.3f} decode-only); {r.num_cached_tokens} prompt tokens cached"
        )
    on, off = best[True], best[False]
    print(
        f"hit-path bookkeeping: {on.mean_ms - off.mean_ms:+.3f} ms/step mean "
        f"({on.admit_mean_ms - off.admit_mean_ms:+.3f} on admitting steps, "
        f"{on.decode_mean_ms - off.decode_mean_ms:+.3f} on decode-only steps)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
