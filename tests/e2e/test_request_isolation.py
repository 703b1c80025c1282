"""One request's bad value or failed step part never fails another request.

The faults are injected (a seeded generator that raises for one seed, an input builder
that raises for one prompt), so these requests pass validation and fail during a step.
Expected outputs of the other requests are the engine's own greedy outputs for the same
prompts run alone.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from inflight import LLM, SamplingParams
from inflight.engine.async_engine import AsyncLLMEngine
from inflight.engine.request_stream import EngineDeadError, RequestFailedError
from inflight.worker import model_runner
from inflight.worker.sampler import Sampler

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [100, 200, 300], list(range(10, 40))]
POISONED_SEED = 4242  # a valid seed; the injected fault makes its generator raise
POISONED_TOKEN = 77  # a valid token id; the injected fault makes inputs with it raise


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), max_num_seqs=8)


@pytest.fixture(scope="module")
def alone(llm: LLM) -> list[list[int]]:
    return [
        llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        for p in PROMPTS
    ]


@pytest.fixture
def poisoned_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    original = Sampler._generator

    def generator(self: Sampler, request_id: str, seed: int) -> Any:
        if seed == POISONED_SEED:
            raise RuntimeError("injected generator fault")
        return original(self, request_id, seed)

    monkeypatch.setattr(Sampler, "_generator", generator)


@pytest.fixture
def poisoned_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    original = model_runner.build_model_inputs

    def build(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if any(POISONED_TOKEN in s.token_ids for s in scheduler_output.scheduled):
            raise RuntimeError("injected input fault")
        return original(scheduler_output, *args, **kwargs)

    monkeypatch.setattr(model_runner, "build_model_inputs", build)


def assert_engine_clean(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    engine.scheduler.check_invariants()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


# ---------------------------------------------------------------- first line: validation


def test_the_issues_seed_is_rejected_when_the_request_is_made(llm: LLM) -> None:
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(max_tokens=4, seed=18446744073709551616)
    # Largest accepted seed samples fine, next to greedy requests that stay unchanged.
    params = [GREEDY, SamplingParams(temperature=1.0, seed=2**63 - 1, max_tokens=12), GREEDY]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert all(o.outputs[0].finish_reason in ("stop", "length") for o in outs)


def test_stop_token_ids_are_checked_against_the_vocabulary(llm: LLM) -> None:
    vocab = llm.llm_engine.vocab_size
    params = SamplingParams(stop_token_ids=[3, vocab])
    message = (
        rf"^token_id\(s\) \[{vocab}\] in stop_token_ids contain out-of-vocab token ids. "
        rf"Vocabulary size: {vocab}$"
    )
    with pytest.raises(ValueError, match=message) as caught:
        llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)
    assert getattr(caught.value, "parameter", None) == "stop_token_ids"
    assert_engine_clean(llm)


def test_a_prompt_token_outside_the_vocabulary_gets_vllms_words(llm: LLM) -> None:
    vocab = llm.llm_engine.vocab_size
    with pytest.raises(ValueError, match=rf"^Token id {vocab} is out of vocabulary.*{vocab}"):
        llm.generate({"prompt_token_ids": [5, vocab]}, GREEDY, use_tqdm=False)


# ---------------------------------------------------------------- second line: isolation


def test_a_sampler_fault_fails_only_that_request_offline(
    llm: LLM, alone: list[list[int]], poisoned_seed: None
) -> None:
    bad = SamplingParams(temperature=1.0, seed=POISONED_SEED, max_tokens=12)
    prompts = [{"prompt_token_ids": p} for p in [PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[2]]]
    outs = llm.generate(prompts, [GREEDY, bad, GREEDY, GREEDY], use_tqdm=False)
    failed = outs[1].outputs[0]
    assert outs[1].finished and failed.finish_reason == "error"
    assert failed.error is not None and "injected generator fault" in failed.error
    assert failed.token_ids == []
    assert [o.outputs[0].token_ids for o in (outs[0], outs[2], outs[3])] == [
        alone[0], alone[1], alone[2]
    ]
    assert_engine_clean(llm)


def test_an_input_fault_fails_only_that_request_offline(
    llm: LLM, alone: list[list[int]], poisoned_inputs: None
) -> None:
    poisoned = [1, 2, POISONED_TOKEN, 3]
    prompts = [{"prompt_token_ids": p} for p in [PROMPTS[0], poisoned, *PROMPTS[1:]]]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert outs[1].outputs[0].finish_reason == "error"
    assert "injected input fault" in (outs[1].outputs[0].error or "")
    assert [o.outputs[0].token_ids for o in (outs[0], outs[2], outs[3])] == alone
    assert_engine_clean(llm)


def test_a_fault_mid_generation_keeps_the_tokens_so_far(
    llm: LLM, alone: list[list[int]], poisoned_inputs: None
) -> None:
    # Greedy output of PROMPTS[2] run alone; poison one of its later tokens.
    token = alone[2][5]
    assert token not in PROMPTS[2] and token not in alone[2][:5]
    global POISONED_TOKEN
    saved, POISONED_TOKEN = POISONED_TOKEN, token
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    finally:
        POISONED_TOKEN = saved
    failed = outs[2].outputs[0]
    assert failed.finish_reason == "error" and failed.token_ids == alone[2][:6]
    others = [o.outputs[0].token_ids for o in outs[:2]]
    assert all(token not in out for out in alone[:2]), "pick a token only PROMPTS[2] makes"
    assert others == alone[:2]
    assert_engine_clean(llm)


def test_over_the_async_engine_only_that_stream_raises(
    llm: LLM, alone: list[list[int]], poisoned_seed: None
) -> None:
    bad = SamplingParams(temperature=1.0, seed=POISONED_SEED, max_tokens=12)

    async def consume(engine: AsyncLLMEngine, rid: str, prompt: list[int],
                      params: SamplingParams) -> list[int] | BaseException:
        tokens: list[int] = []
        try:
            async for delta in engine.generate(rid, {"prompt_token_ids": prompt}, params):
                tokens += delta.token_ids
        except EngineDeadError as error:
            return error
        return tokens

    async def main() -> list[Any]:
        engine = AsyncLLMEngine(llm.llm_engine)
        engine.start()
        try:
            results = await asyncio.gather(
                consume(engine, "g0", PROMPTS[0], GREEDY),
                consume(engine, "bad", PROMPTS[1], bad),
                consume(engine, "g1", PROMPTS[1], GREEDY),
                consume(engine, "g2", PROMPTS[2], GREEDY),
            )
            assert engine.is_healthy
            return list(results)
        finally:
            await engine.shutdown()

    g0, failure, g1, g2 = asyncio.run(main())
    assert isinstance(failure, RequestFailedError)
    assert "injected generator fault" in str(failure)
    assert [g0, g1, g2] == alone
    assert_engine_clean(llm)


def test_over_http_the_failed_request_gets_an_openai_error(
    tiny_llama_dir: Path, poisoned_seed: None
) -> None:
    from fastapi.testclient import TestClient

    from inflight.engine.llm_engine import LLMEngine
    from inflight.entrypoints.openai.api_server import build_app
    from inflight.entrypoints.openai.serving import ServerConfig

    engine = AsyncLLMEngine(LLMEngine.from_options(str(tiny_llama_dir)))
    app = build_app(engine, ServerConfig(served_model_names=("tiny",)))
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4, "seed": POISONED_SEED}
    with TestClient(app) as client:
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["type"] == "server_error" and "injected generator fault" in error["message"]

        streamed = client.post("/v1/completions", json={**body, "stream": True})
        events = [line.removeprefix("data: ") for line in streamed.text.splitlines() if line]
        assert events[-1] == "[DONE]"
        assert "injected generator fault" in json.loads(events[-2])["error"]["message"]

        # and the server still serves
        ok = client.post("/v1/completions", json={**body, "seed": 1})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
