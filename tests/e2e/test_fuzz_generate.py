"""Fuzzing ``SamplingParams`` through the engine on the tiny model.

Property: for random options that ``SamplingParams`` accepts (the construction property is
in ``tests/core/test_fuzz_sampling_params.py``), ``add_request`` either refuses them with a
``ValueError``/``TypeError`` and changes nothing, or the request finishes within a bounded
number of steps with at most ``max_tokens`` tokens per completion; a greedy request
running beside it gives its run-alone output, and every KV block is free afterwards.

``n`` and ``max_tokens`` are clamped to tiny values so each example costs a few steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from helpers.fuzz_strategies import accepted_sampling_kwargs
from inflight import LLM, SamplingParams
from inflight.sampling_params import InvalidRequestError

PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9]}
GREEDY_PROMPT = {"prompt_token_ids": [40, 41, 42]}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
MAX_STEPS = 200  # a 3-token request, even chunked and preempted, needs far fewer

CASES = {"refused_on_construction": 0, "refused_by_engine": 0, "generated": 0}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), max_model_len=128, max_num_seqs=4)


@pytest.fixture(scope="module")
def greedy_alone(llm: LLM) -> list[int]:
    return list(llm.generate([GREEDY_PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


def _tiny(params: SamplingParams) -> SamplingParams:
    """The same options with n <= 2 and max_tokens <= 3, so an example costs a few steps."""
    max_tokens = 3 if params.max_tokens is None else min(params.max_tokens, 3)
    return dataclasses.replace(
        params, n=min(params.n, 2), best_of=None, max_tokens=max_tokens,
        min_tokens=min(params.min_tokens, max_tokens),
    )


def _run(llm: LLM, params: SamplingParams, tag: str) -> dict[str, Any]:
    engine = llm.llm_engine
    outputs: dict[str, Any] = {}
    engine.add_request(f"greedy-{tag}", GREEDY_PROMPT, GREEDY)
    try:
        engine.add_request(f"fuzz-{tag}", PROMPT, params)
    except (ValueError, TypeError) as error:  # InvalidRequestError is a ValueError
        CASES["refused_by_engine"] += 1
        outputs["refused"] = error
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                outputs[out.request_id.split("-")[0]] = out
    assert not engine.has_unfinished_requests(), f"no end after {MAX_STEPS} steps: {params}"
    return outputs


@settings(
    max_examples=100, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.function_scoped_fixture],
)
@given(kwargs=accepted_sampling_kwargs())  # junk types: tests/core's property
def test_accepted_options_generate_without_disturbing_others(
    llm: LLM, greedy_alone: list[int], kwargs: dict[str, Any]
) -> None:
    try:
        params = _tiny(SamplingParams(**kwargs))
    except InvalidRequestError:
        CASES["refused_on_construction"] += 1
        return
    tag = str(sum(CASES.values()))
    outputs = _run(llm, params, tag)
    assert list(outputs["greedy"].outputs[0].token_ids) == greedy_alone
    if "refused" not in outputs:
        CASES["generated"] += 1
        fuzz = outputs["fuzz"]
        assert len(fuzz.outputs) == params.n
        for completion in fuzz.outputs:
            assert len(completion.token_ids) <= (params.max_tokens or 0) or params.max_tokens == 0
    kv = llm.llm_engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks, "KV blocks leaked"


def test_report_cases_tried(
    llm: LLM, greedy_alone: list[int], report_figure: Callable[[str], None]
) -> None:
    """Runs after the property (file order): the figures for the README, and the engine
    still answers a greedy request as it did alone."""
    report_figure(
        f"hypothesis SamplingParams through the engine: {sum(CASES.values())} {dict(CASES)}"
    )
    assert list(llm.generate([GREEDY_PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) \
        == greedy_alone
    if sum(CASES.values()):
        assert CASES["generated"] > 0
