"""The simulator against the engine: same schedule, the seed's numbers, load monotonicity.

The reference for every schedule is the real engine's own step trace on the tiny model
(same workload, same options, greedy, EOS ignored); for the seed example it is the source
document's arithmetic (8 slots, one request of 500 tokens and seven of 50: static
batching works 500 + 7 x 50 = 850 of 8 x 500 = 4000 slot-steps).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from inflight.bench import workloads
from inflight.bench.report import slot_steps
from inflight.bench.workloads import Workload, WorkloadRequest
from inflight.planner.cost_model import CostModel
from inflight.planner.simulator import simulate

# Deterministic and simple: only the schedule is compared against the engine.
UNIT_COST = CostModel(intercept_s=0.01, per_prefill_token_s=1e-4, per_decode_seq_s=1e-3)


def _step_shape(record) -> tuple:
    return (
        [(e.request_id, e.num_tokens, e.kind, e.num_cached_tokens, e.slot) for e in record.entries],
        record.preempted, sorted(record.finished), record.num_running, record.num_waiting,
        record.kv_blocks_used, record.kv_blocks_total, record.idle_slots,
    )


def _shared_prefix_workload(vocab: int = 512, n: int = 10, seed: int = 0) -> Workload:
    """Prompts of 20..90 tokens; every other one starts with the same 32 tokens."""
    rng = random.Random(seed)
    common = [rng.randrange(3, vocab) for _ in range(32)]
    requests = []
    for i in range(n):
        own = [rng.randrange(3, vocab) for _ in range(rng.randint(20, 60))]
        prompt = common + own if i % 2 else own
        requests.append(WorkloadRequest(i, prompt, rng.randint(3, 24)))
    return Workload("shared-prefix", requests)


CASES = {
    # chunked prefill under a small budget, a cache small enough to preempt, prefix hits
    "continuous-chunked-preempting": dict(
        batching="continuous", max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=14
    ),
    "continuous-no-prefix-cache": dict(
        batching="continuous", max_num_seqs=3, max_num_batched_tokens=48,
        enable_prefix_caching=False,
    ),
    "static": dict(batching="static", max_num_seqs=4, max_num_batched_tokens=64),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_simulated_schedule_equals_the_real_engines_trace(tiny_llama_dir: Path, case: str) -> None:
    from inflight import LLM, SamplingParams

    options = CASES[case]
    workload = _shared_prefix_workload()
    llm = LLM(str(tiny_llama_dir), dtype="float32", record_trace=True, **options)
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
        for r in workload.requests
    ]
    outputs = llm.generate(
        [{"prompt_token_ids": r.prompt_token_ids} for r in workload.requests], params,
        use_tqdm=False,
    )
    assert [len(o.outputs[0].token_ids) for o in outputs] == [r.max_tokens for r in workload.requests]
    real = llm.step_trace.records

    sim = simulate(workload, UNIT_COST, max_model_len=llm.llm_engine.max_model_len, **options)
    assert len(sim.records) == len(real)
    for simulated, measured in zip(sim.records, real, strict=True):
        assert _step_shape(simulated) == _step_shape(measured), f"step {measured.step}"
    assert sim.num_preemptions == llm.llm_engine.scheduler.num_preemptions
    if case == "continuous-chunked-preempting":
        # the case exercises what it says
        assert sim.num_preemptions > 0
        assert any(e.num_cached_tokens for r in real for e in r.entries)
        assert any(e.kind == "prefill" and e.num_tokens == 32 for r in real for e in r.entries)
    # every simulated request produced exactly its workload's output length
    assert [len(r.token_times) for r in sim.requests] == [r.max_tokens for r in workload.requests]


def test_seed8_through_the_simulator_matches_the_source_document() -> None:
    for batching in ("static", "continuous"):
        result = simulate(workloads.seed8(), UNIT_COST, batching=batching, max_num_seqs=8)
        counts = slot_steps(result.records, 8)
        assert counts.num_steps == 500 and counts.working == 850
        expected_idle = 1 - 850 / 4000 if batching == "static" else 0.0
        assert counts.idle_share == pytest.approx(expected_idle)
    # Twice the requests: static runs two 500-step batches; continuous starts the second
    # group's long request in a slot freed after the first 50 steps: 50 + 500 steps.
    static = simulate(workloads.seed8().repeat(2), UNIT_COST, batching="static", max_num_seqs=8)
    continuous = simulate(workloads.seed8().repeat(2), UNIT_COST, max_num_seqs=8)
    assert len(static.records) == 1000
    assert len(continuous.records) == 550
    assert slot_steps(continuous.records, 8).idle == 0


def test_simulated_latency_is_monotone_in_load() -> None:
    summaries = [
        simulate(workloads.online(rate).head(60), UNIT_COST).serve_summary()
        for rate in (0.5, 2, 8, 32, 128)
    ]
    for key in ("mean_ttft_ms", "p99_ttft_ms", "mean_e2el_ms", "mean_tpot_ms"):
        values = [s[key] for s in summaries]
        assert values == sorted(values), key
    # and overload shows: the heaviest load waits far longer than the lightest
    assert summaries[-1]["mean_ttft_ms"] > 5 * summaries[0]["mean_ttft_ms"]
    assert all(s["total_output_tokens"] == summaries[0]["total_output_tokens"] for s in summaries)


def test_prefix_caching_is_honoured() -> None:
    workload = _shared_prefix_workload()
    on = simulate(workload, UNIT_COST, max_num_seqs=4, max_model_len=512)
    off = simulate(workload, UNIT_COST, max_num_seqs=4, max_model_len=512,
                   enable_prefix_caching=False)

    def prefill_tokens(result) -> int:
        return sum(e.num_tokens for r in result.records for e in r.entries if e.kind == "prefill")

    hits = on.serve_summary()["prefix_cache_hit_tokens"]
    assert hits > 0 and off.serve_summary()["prefix_cache_hit_tokens"] == 0
    assert prefill_tokens(off) - prefill_tokens(on) == hits


def test_arrivals_wait_for_their_time_and_an_idle_engine_jumps_ahead() -> None:
    requests = [WorkloadRequest(0, list(range(1000, 1010)), 3, 0.0),
                WorkloadRequest(1, list(range(2000, 2010)), 3, 100.0)]
    result = simulate(Workload("two", requests), UNIT_COST)
    first, second = result.requests
    step_prefill = UNIT_COST.intercept_s + 10 * UNIT_COST.per_prefill_token_s
    step_decode = UNIT_COST.intercept_s + UNIT_COST.per_decode_seq_s
    assert first.token_times == pytest.approx(
        [step_prefill, step_prefill + step_decode, step_prefill + 2 * step_decode]
    )
    assert second.token_times[0] == pytest.approx(100.0 + step_prefill)
    assert result.serve_summary()["mean_ttft_ms"] == pytest.approx(step_prefill * 1e3)


def _consistency_cases() -> dict[str, tuple[Workload, dict]]:
    capped = Workload("capped", [  # the first asks for more than the 256-token context
        WorkloadRequest(0, list(range(1000, 1100)), 400, 0.0),
        WorkloadRequest(1, list(range(2000, 2040)), 30, 0.05),
    ])
    return {
        "online": (workloads.online(4.0).head(40), {}),
        "mixed-small-cache": (workloads.mixed().head(30),
                              dict(max_num_seqs=8, max_num_batched_tokens=128, num_kv_blocks=120)),
        "seed8-static": (workloads.seed8(), dict(batching="static", max_num_seqs=8)),
        "capped-by-context": (capped, dict(max_model_len=256)),
        "all-at-once": (Workload("t0", [WorkloadRequest(i, [5 + i] * 20, 10) for i in range(30)]),
                        dict(max_num_seqs=4)),
    }


@pytest.mark.parametrize("case", sorted(_consistency_cases()))
def test_the_reports_agree_with_themselves(case: str) -> None:
    """Throughput x duration = tokens in both reports (the bench table counts the tokens
    made, not the workload's max_tokens: a request capped by the context makes fewer),
    percentiles are ordered, no request finishes before its first token, and the engine
    is never busy longer than the run."""
    workload, options = _consistency_cases()[case]
    result = simulate(workload, UNIT_COST, **options)
    serve, bench = result.serve_summary(), result.bench_report()
    made = sum(len(r.token_times) for r in result.requests)
    assert serve["total_output_tokens"] == bench.num_output_tokens == made
    assert serve["output_throughput"] * serve["duration_s"] == pytest.approx(made)
    assert bench.output_tokens_per_s * bench.wall_time_s == pytest.approx(made)
    assert bench.num_prompt_tokens == serve["total_input_tokens"]
    for stat in ("ttft", "tpot", "itl", "e2el"):
        ordered = [serve[f"{p}_{stat}_ms"] for p in ("median", "p95", "p99")]
        assert ordered == sorted(ordered), stat
    assert all(x.ttft_s <= x.e2e_s for x in bench.requests)
    assert 0 < result.busy_s <= result.duration_s + 1e-9
    if case == "capped-by-context":
        assert made == (256 - 100) + 30


def test_a_request_the_engine_refuses_fails_alone() -> None:
    """A prompt over the context, or one needing more KV blocks than the cache has, is
    refused as the server refuses it (a 400): counted as failed, the rest simulated;
    the run stops with one error only when no request can be served."""
    long_prompt = WorkloadRequest(1, list(range(1000, 1300)), 5, 0.02)  # > max_model_len
    huge_output = WorkloadRequest(3, list(range(3000, 3010)), 200, 0.5)  # > the KV cache
    ok = [WorkloadRequest(0, list(range(2000, 2040)), 8, 0.0),
          WorkloadRequest(2, list(range(4000, 4020)), 4, 0.04)]
    workload = Workload("some-too-long", [ok[0], long_prompt, ok[1], huge_output])
    result = simulate(workload, UNIT_COST, max_model_len=256, num_kv_blocks=8)
    summary = result.serve_summary()
    assert (summary["completed"], summary["failed"]) == (2, 2)
    assert summary["total_output_tokens"] == 8 + 4
    assert [r.request_id for r in result.refused] == ["1", "3"]
    note = result.refusal_note()
    assert note is not None and note.startswith("2 of 4 requests refused")
    assert "request 1: This model's maximum context length is 256 tokens" in note
    assert result.bench_report().num_requests == 2
    with pytest.raises(ValueError, match="no request of only-long can be served: request 1: "):
        simulate(Workload("only-long", [long_prompt]), UNIT_COST, max_model_len=256)


def test_huge_engine_sizes_cost_what_the_workload_uses() -> None:
    """max_num_seqs and num_kv_blocks of 10**6 (a sweep's far end, or a typo) simulate in
    memory that follows the workload, not the sizes: each used to allocate per slot and
    per block up front, and a billion slots was killed for memory."""
    import tracemalloc

    tracemalloc.start()
    try:
        result = simulate(workloads.seed8(), UNIT_COST, max_num_seqs=10**6, num_kv_blocks=10**6)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(result.records) == 500 and result.records[0].num_slots == 10**6
    assert peak < 30 << 20, f"peak {peak >> 20} MiB"


def test_arrivals_too_late_for_the_clock_are_refused() -> None:
    """At 1e300 s a double cannot hold a step's duration: TTFT came out 0 ms or
    wrong (a rate of 1e-300 req/s, or such arrival_s in a file). Refused, named."""
    from inflight.planner.sweep import poisson_arrivals

    late = Workload("late", [WorkloadRequest(0, [5, 6, 7], 3, 1e300)])
    with pytest.raises(ValueError, match="late: the last request arrives at 1e[+]300 s"):
        simulate(late, UNIT_COST)
    with pytest.raises(ValueError, match="beyond 1e[+]09 s"):
        simulate(poisson_arrivals(workloads.seed8(), 1e-300), UNIT_COST)
    year = Workload("a-year", [WorkloadRequest(0, [5, 6, 7], 3, 3.2e7)])
    first = simulate(year, UNIT_COST).requests[0]
    assert first.token_times[0] - first.arrival_s == pytest.approx(0.0103)


def test_a_context_longer_than_the_models_is_refused_as_the_engine_does() -> None:
    """max_model_len above the calibrated model's context was simulated (the engine
    refuses it: 'exceeds the model's context length'); its KV sizing used it too."""
    from inflight.planner.simulator import make_sim_config

    with pytest.raises(ValueError, match=r"max_model_len=10000 exceeds the calibrated model's "
                       r"context length \(8192\)"):
        simulate(workloads.seed8(), UNIT_COST, max_model_len=10_000)
    assert make_sim_config(UNIT_COST, max_model_len=8192).scheduler.max_model_len == 8192
