"""Greedy outputs equal transformers' generate on a tiny random Llama, whatever the schedule."""

from __future__ import annotations

import random

import pytest
import torch

from helpers.reference import assert_matches_reference, hf_greedy
from helpers.tiny_model import VOCAB_SIZE
from inflight import LLM, SamplingParams

PROMPT_LENGTHS = [1, 2, 5, 15, 16, 17, 31, 33, 64, 100]
MAX_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def references(tiny_llama_dir, prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    return [hf_greedy(model, p, MAX_NEW_TOKENS) for p in prompts]


SCHEDULES = {
    "one-at-a-time": dict(max_num_seqs=1),
    "all-at-once": dict(max_num_seqs=32),
    "tiny-kv-cache-preempts": dict(max_num_seqs=8, num_kv_blocks=32, block_size=4),
    "tiny-token-budget-chunks": dict(max_num_seqs=8, max_num_batched_tokens=7),
    "static-batching": dict(max_num_seqs=4, batching="static"),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_greedy_matches_transformers(tiny_llama_dir, prompts, references, schedule):
    llm = LLM(str(tiny_llama_dir), dtype="float32", record_trace=True, **SCHEDULES[schedule])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    for prompt, ref, out in zip(prompts, references, outputs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert_matches_reference(out.outputs[0].token_ids, ref, f"{schedule} len={len(prompt)}")

    trace = llm.step_trace.records
    if schedule == "tiny-kv-cache-preempts":
        assert llm.llm_engine.scheduler.num_preemptions > 0
        assert any(r.preempted for r in trace)
    if schedule == "tiny-token-budget-chunks":
        assert max(r.num_batched_tokens for r in trace) <= 7
        chunked = [p for p in prompts if len(p) > 7]
        assert chunked and sum(1 for r in trace for e in r.entries if e.kind == "prefill") > len(
            prompts
        )
    if schedule == "one-at-a-time":
        assert max(r.batch_size for r in trace) == 1
    # every block came back
    kv = llm.llm_engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
