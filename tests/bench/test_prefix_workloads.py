"""The prefix-caching workloads (shared-prefix, multi-turn) and the runner that honours
multi-turn dependencies; caching on computes far less prefill for identical outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from inflight.bench import workloads
from inflight.bench.engine_run import RunResult, generate_workload, run_inflight
from inflight.engine.step_trace import StepRecord
from inflight.entrypoints.cli import main
from inflight.outputs import RequestOutput


def test_shared_prefix_shape_and_determinism() -> None:
    w = workloads.shared_prefix()
    assert w == workloads.shared_prefix() == workloads.named("shared-prefix")
    assert len(w.requests) == 64 and not w.has_dependencies
    system = w.requests[0].prompt_token_ids[:512]
    suffixes = set()
    for r in w.requests:
        assert r.prompt_token_ids[:512] == system
        suffix = tuple(r.prompt_token_ids[512:])
        assert 16 <= len(suffix) <= 128 and 32 <= r.max_tokens <= 128
        suffixes.add(suffix[:4])
    assert len(suffixes) == 64  # distinct from their first tokens on
    assert workloads.shared_prefix(seed=1) != w


def test_multi_turn_shape_and_determinism() -> None:
    w = workloads.multi_turn()
    assert w == workloads.named("multi-turn") and len(w.requests) == 16 * 5
    for conversation in range(16):
        turns = w.requests[conversation * 5 : conversation * 5 + 5]
        assert turns[0].after is None and 64 <= len(turns[0].prompt_token_ids) <= 256
        for previous, turn in zip(turns, turns[1:], strict=False):
            assert turn.after == previous.id  # each turn continues the one before it
            assert 16 <= len(turn.prompt_token_ids) <= 128
        assert all(32 <= t.max_tokens <= 128 for t in turns)
    lens = workloads.full_prompt_lens(w.requests)
    second = w.requests[1]
    assert lens[1] == len(w.requests[0].prompt_token_ids) + w.requests[0].max_tokens + len(
        second.prompt_token_ids
    )
    assert w.num_prompt_tokens == sum(lens.values())


def test_multi_turn_round_trips_through_the_cli(tmp_path: Path) -> None:
    path = tmp_path / "mt.jsonl"
    assert main(["bench", "workload", "multi-turn", "-o", str(path)]) == 0
    back = workloads.resolve(str(path))
    assert back.requests == workloads.multi_turn().requests
    # Independent requests keep make_workload.py's four fields.
    first = workloads.multi_turn().requests[0].to_json()
    assert set(first) == {"id", "prompt_token_ids", "max_tokens", "arrival_s"}


def test_head_and_repeat_keep_dependencies() -> None:
    w = workloads.multi_turn(num_conversations=2, num_turns=3)
    doubled = w.repeat(2)
    assert [r.after for r in doubled.requests] == [None, 0, 1, None, 3, 4, None, 6, 7, None, 9, 10]
    assert w.head(4).requests[3].after is None
    folded, _ = workloads.fit_to_vocab(w, 512)
    assert [r.after for r in folded.requests] == [r.after for r in w.requests]


def test_a_dependency_on_a_later_request_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"id": 0, "prompt_token_ids": [5], "max_tokens": 2, "after": 1}\n'
        '{"id": 1, "prompt_token_ids": [5], "max_tokens": 2}\n'
    )
    with pytest.raises(ValueError, match="comes after 1"):
        workloads.resolve(str(bad))


# ---------------------------------------------------------------- runs on the tiny model

SMALL = dict(num_conversations=3, num_turns=4, first_len=(40, 80), user_len=(8, 24))


def _small_multi_turn() -> workloads.Workload:
    w = workloads.multi_turn(**SMALL, output_len=(8, 24))  # type: ignore[arg-type]
    return workloads.fit_to_vocab(w, 512)[0]


def _run(model: Path, caching: bool) -> RunResult:
    options = dict(dtype="float32", max_num_seqs=4, enable_prefix_caching=caching)
    return run_inflight(_small_multi_turn(), str(model), options, warmup=False)


@pytest.fixture(scope="module")
def runs(tiny_llama_dir: Path) -> dict[bool, RunResult]:
    return {caching: _run(tiny_llama_dir, caching) for caching in (True, False)}


@pytest.fixture(scope="module")
def traced(tiny_llama_dir: Path) -> tuple[list[RequestOutput], list[StepRecord]]:
    from inflight import LLM

    llm = LLM(str(tiny_llama_dir), dtype="float32", max_num_seqs=4, record_trace=True)
    return generate_workload(llm.llm_engine, _small_multi_turn()), list(llm.step_trace.records)


def test_a_turn_is_added_only_after_its_predecessor_finished(
    traced: tuple[list[RequestOutput], list[StepRecord]],
) -> None:
    outputs, records = traced
    w = _small_multi_turn()
    first_step: dict[str, int] = {}
    finished_step: dict[str, int] = {}
    for record in records:
        for entry in record.entries:
            first_step.setdefault(entry.request_id, record.step)
        for request_id in record.finished:
            finished_step[request_id] = record.step
    by_id = dict(zip((r.id for r in w.requests), outputs, strict=True))
    overlapping = 0
    for r, out in zip(w.requests, outputs, strict=True):
        if r.after is None:
            assert first_step[out.request_id] == records[0].step  # all start at once
            continue
        assert first_step[out.request_id] > finished_step[by_id[r.after].request_id]
        overlapping += first_step[out.request_id] < max(finished_step.values())
    assert overlapping  # conversations did run side by side


def test_the_prompt_starts_with_the_previous_prompt_and_answer(
    traced: tuple[list[RequestOutput], list[StepRecord]],
) -> None:
    outputs, _ = traced
    w = _small_multi_turn()
    by_id = dict(zip((r.id for r in w.requests), outputs, strict=True))
    for r, out in zip(w.requests, outputs, strict=True):
        assert len(out.outputs[0].token_ids) == r.max_tokens
        if r.after is None:
            assert out.prompt_token_ids == r.prompt_token_ids
            continue
        previous = by_id[r.after]
        history = [*previous.prompt_token_ids, *previous.outputs[0].token_ids]
        assert out.prompt_token_ids == [*history, *r.prompt_token_ids]
        assert previous.metrics is not None and out.metrics is not None
        assert previous.metrics.finished_time is not None
        assert out.metrics.arrival_time >= previous.metrics.finished_time
        assert out.num_cached_tokens > 0  # the history is found in the cache


def test_caching_computes_far_less_prefill_for_the_same_tokens(
    runs: dict[bool, RunResult],
) -> None:
    on, off = runs[True].report, runs[False].report
    assert on.num_prompt_tokens == off.num_prompt_tokens == _small_multi_turn().num_prompt_tokens
    assert on.num_preemptions == off.num_preemptions == 0
    assert off.num_cached_tokens == 0 and off.num_prefill_tokens_computed == off.num_prompt_tokens
    assert on.num_prefill_tokens_computed == on.num_prompt_tokens - on.num_cached_tokens
    assert on.num_prefill_tokens_computed * 2 < off.num_prefill_tokens_computed
    assert on.options["enable_prefix_caching"] and not off.options["enable_prefix_caching"]


def test_caching_on_and_off_give_identical_greedy_tokens(
    tiny_llama_dir: Path, traced: tuple[list[RequestOutput], list[StepRecord]]
) -> None:
    from inflight import LLM

    with_cache, _ = traced
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_num_seqs=4, enable_prefix_caching=False)
    without = generate_workload(llm.llm_engine, _small_multi_turn())
    assert sum(o.num_cached_tokens for o in with_cache) > 0
    assert all(o.num_cached_tokens == 0 for o in without)
    # Every later prompt holds earlier answers, so equal prompts mean equal histories too.
    assert [o.prompt_token_ids for o in with_cache] == [o.prompt_token_ids for o in without]
    assert [o.outputs[0].token_ids for o in with_cache] == [o.outputs[0].token_ids for o in without]


def test_the_fake_model_count_matches_the_model_run(runs: dict[bool, RunResult]) -> None:
    """scheduler_cost --prefill-counts: the real core with a fake model counts the prefill
    tokens a model run computes (hits depend on token equality, not on the tokens)."""
    from inflight.bench.scheduler_cost import count_prefill

    for caching, result in runs.items():
        options = result.report.options
        counted = count_prefill(
            _small_multi_turn(),
            caching,
            num_blocks=options["num_kv_blocks"],
            block_size=options["block_size"],
            max_num_seqs=options["max_num_seqs"],
            max_num_batched_tokens=options["max_num_batched_tokens"],
        )
        assert counted.num_prefill_tokens_computed == result.report.num_prefill_tokens_computed
        assert counted.num_cached_tokens == result.report.num_cached_tokens
