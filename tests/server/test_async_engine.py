"""The async engine in-process: deltas, joining between steps, aborts, idling, failures."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers.step_gate import StepGate, once_all_have
from inflight import LLM, SamplingParams
from inflight.engine.async_engine import AsyncLLMEngine
from inflight.engine.llm_engine import LLMEngine
from inflight.engine.request_stream import EngineDeadError, RequestDelta
from inflight.metrics.stats import FinishedRequestStats


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir))


@pytest.fixture
def engine(llm: LLM) -> Iterator[LLMEngine]:
    yield llm.llm_engine
    # Whatever a test did, the engine is left with no request and no block in use.
    assert not llm.llm_engine.has_unfinished_requests()
    llm.llm_engine.scheduler.check_invariants()
    assert llm.llm_engine.kv_cache.pool.num_used_blocks == 0


class Recorder:
    def __init__(self) -> None:
        self.finished: list[FinishedRequestStats] = []

    def on_request_finished(self, stats: FinishedRequestStats) -> None:
        self.finished.append(stats)


def greedy(max_tokens: int, **extra: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)


async def drain(
    async_engine: AsyncLLMEngine, request_id: str, prompt: Any, params: SamplingParams
) -> list[RequestDelta]:
    return [d async for d in async_engine.generate(request_id, prompt, params)]


def run(engine: LLMEngine, body: Any, observers: tuple[Any, ...] = ()) -> Any:
    async def main() -> Any:
        async_engine = AsyncLLMEngine(engine, observers)
        async_engine.start()
        try:
            return await body(async_engine)
        finally:
            await async_engine.shutdown()

    return asyncio.run(main())


def test_deltas_add_up_to_the_offline_output(llm: LLM, engine: LLMEngine) -> None:
    prompts = [[3 + i, 50 + i, 100 + i] for i in range(6)]
    expected = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(10), use_tqdm=False)
    recorder = Recorder()

    async def body(async_engine: AsyncLLMEngine) -> list[list[RequestDelta]]:
        return await asyncio.gather(
            *(
                drain(async_engine, f"r{i}", {"prompt_token_ids": p}, greedy(10))
                for i, p in enumerate(prompts)
            )
        )

    for deltas, want in zip(run(engine, body, (recorder,)), expected, strict=True):
        assert "".join(d.text for d in deltas) == want.outputs[0].text
        assert [t for d in deltas for t in d.token_ids] == want.outputs[0].token_ids
        assert [d.finished for d in deltas] == [False] * 9 + [True]
        assert deltas[-1].finish_reason == "length" and deltas[-1].num_output_tokens == 10
    assert sorted(s.finish_reason for s in recorder.finished) == ["length"] * 6
    assert all(
        s.time_to_first_token is not None and s.time_per_output_token is not None
        for s in recorder.finished
    )


def test_a_new_request_joins_the_next_step_while_another_runs(engine: LLMEngine) -> None:
    recorder = Recorder()
    # "long" makes 5 tokens, then waits (empty steps) until "short" has joined, so it
    # cannot finish first however fast the machine: short needs 3 steps, long 195 more.
    gate = StepGate(
        engine,
        lambda live: [r.request_id for r in live] == ["long"] and live[0].num_output_tokens >= 5,
    )

    async def body(async_engine: AsyncLLMEngine) -> tuple[int, int]:
        long = await async_engine.add_request("long", [3, 4, 5], greedy(200))
        seen = 0
        async for _ in long:
            seen += 1
            if seen == 5:
                break
        short = await async_engine.add_request("short", [6, 7], greedy(3))
        added_at = async_engine.stats.num_steps_total
        first = await short.__anext__()
        # The snapshot may lag the delivered delta by a step; the join itself is immediate.
        steps_to_first_token = async_engine.stats.num_steps_total - added_at
        rest = [d async for d in short]
        long.close()
        return steps_to_first_token, len([first, *rest])

    try:
        steps, num_short = run(engine, body, (recorder,))
    finally:
        gate.remove()
    assert steps <= 3
    assert num_short == 3
    # The short request finished while the long one was still running (then aborted).
    assert [s.finish_reason for s in recorder.finished] == ["length", "abort"]


def test_abort_frees_blocks_before_the_next_step(engine: LLMEngine) -> None:
    recorder = Recorder()
    # After 3 tokens the engine makes no progress until the abort arrives.
    gate = StepGate(engine, once_all_have(3))

    async def body(async_engine: AsyncLLMEngine) -> tuple[int, int]:
        stream = await async_engine.add_request("victim", [3, 4, 5], greedy(400))
        async for delta in stream:
            if delta.num_output_tokens >= 3:
                break
        used_before = async_engine.stats.num_kv_blocks_used
        stream.close()
        deadline = time.monotonic() + 60  # fails only an engine that never frees them
        while async_engine.stats.num_kv_blocks_used and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return used_before, async_engine.stats.num_kv_blocks_used

    try:
        used_before, used_after = run(engine, body, (recorder,))
    finally:
        gate.remove()
    assert not gate.gave_up
    assert used_before >= 1 and used_after == 0
    assert [s.finish_reason for s in recorder.finished] == ["abort"]
    assert recorder.finished[0].num_output_tokens < 400


def test_idle_engine_blocks_instead_of_spinning(engine: LLMEngine, monkeypatch: Any) -> None:
    calls = 0
    original = engine.has_unfinished_requests

    def counting() -> bool:
        nonlocal calls
        calls += 1
        return original()

    monkeypatch.setattr(engine, "has_unfinished_requests", counting)

    async def body(async_engine: AsyncLLMEngine) -> tuple[int, int]:
        await drain(async_engine, "warm", [3, 4], greedy(2))
        await asyncio.sleep(0.1)
        idle_start = calls
        await asyncio.sleep(0.5)
        return idle_start, calls

    idle_start, idle_end = run(engine, body)
    assert idle_end - idle_start <= 2  # woken by nothing: the thread sleeps on its queue


def test_rejected_request_raises_value_error(engine: LLMEngine) -> None:
    async def body(async_engine: AsyncLLMEngine) -> list[RequestDelta]:
        with pytest.raises(ValueError, match="max_model_len"):
            await async_engine.add_request("too-long", [5] * 600, greedy(4))
        with pytest.raises(ValueError, match="vocabulary"):
            await async_engine.add_request("bad-ids", [9999], greedy(4))
        return await drain(async_engine, "fine", [3, 4], greedy(4))

    assert len(run(engine, body)) == 4


def test_a_failing_step_fails_its_requests_and_serving_continues(
    engine: LLMEngine, monkeypatch: Any
) -> None:
    original = engine.runner.execute_model
    failures = {"left": 1}

    def flaky(*args: Any, **kwargs: Any) -> Any:
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("simulated kernel failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute_model", flaky)
    recorder = Recorder()

    async def body(async_engine: AsyncLLMEngine) -> list[RequestDelta]:
        with pytest.raises(EngineDeadError, match="simulated kernel failure"):
            await drain(async_engine, "unlucky", [3, 4, 5], greedy(8))
        assert async_engine.is_healthy
        return await drain(async_engine, "lucky", [3, 4, 5], greedy(8))

    assert len(run(engine, body, (recorder,))) == 8
    assert [s.finish_reason for s in recorder.finished] == ["error", "length"]


def test_shutdown_aborts_requests_in_flight(engine: LLMEngine) -> None:
    gate = StepGate(engine, once_all_have(1))  # no progress after the first token

    async def main() -> RequestDelta:
        async_engine = AsyncLLMEngine(engine)
        async_engine.start()
        stream = await async_engine.add_request("cut", [3, 4, 5], greedy(400))
        await stream.__anext__()
        await async_engine.shutdown()
        last = None
        async for delta in stream:
            last = delta
        assert last is not None
        with pytest.raises(RuntimeError, match="shutting down"):
            await async_engine.add_request("late", [3], greedy(2))
        return last

    try:
        last = asyncio.run(main())
    finally:
        gate.remove()
    assert last.finished and last.finish_reason == "abort"


def test_n_completions_stream_interleaved_by_index(llm: LLM, engine: LLMEngine) -> None:
    prompt = {"prompt_token_ids": [5, 60, 7, 80, 9, 11]}
    params = SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=6, ignore_eos=True, logprobs=2)
    expected = llm.generate([prompt], params, use_tqdm=False)[0]
    recorder = Recorder()

    async def body(async_engine: AsyncLLMEngine) -> list[RequestDelta]:
        return await drain(async_engine, "multi", prompt, params)

    deltas = run(engine, body, (recorder,))
    assert {d.index for d in deltas} == {0, 1, 2}
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    for completion in expected.outputs:
        mine = [d for d in deltas if d.index == completion.index]
        assert [t for d in mine for t in d.token_ids] == completion.token_ids
        assert "".join(d.text for d in mine) == completion.text
        assert [p for d in mine for p in d.logprobs or []] == completion.logprobs
        assert mine[-1].finish_reason == "length"
        assert mine[-1].cumulative_logprob == completion.cumulative_logprob
    assert [s.n for s in recorder.finished] == [3]
    assert recorder.finished[0].num_output_tokens == 18


def test_prompt_logprobs_with_no_generation_stream_one_final_delta(llm: LLM, engine: LLMEngine) -> None:
    prompt = {"prompt_token_ids": [5, 60, 7, 80]}
    params = SamplingParams(max_tokens=0, prompt_logprobs=1)
    expected = llm.generate([prompt], params, use_tqdm=False)[0]

    async def body(async_engine: AsyncLLMEngine) -> list[RequestDelta]:
        return await drain(async_engine, "echo", prompt, params)

    deltas = run(engine, body)
    assert len(deltas) == 1 and deltas[0].finished and deltas[0].finish_reason == "length"
    assert deltas[0].token_ids == [] and deltas[0].prompt_logprobs == expected.prompt_logprobs
