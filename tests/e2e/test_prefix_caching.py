"""Prefix caching leaves greedy outputs token-identical to transformers, and really reuses
blocks: shared system prompts, a cached and an uncached request in one step, chunked
prefill starting mid-prompt after a hit, preemption and eviction with caching on."""

from __future__ import annotations

import random

import pytest
import torch

from helpers.reference import assert_matches_reference, hf_greedy
from helpers.tiny_model import VOCAB_SIZE
from inflight import LLM, SamplingParams

MAX_NEW_TOKENS = 12
BLOCK = 4


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(77)
    system = [rng.randrange(3, VOCAB_SIZE) for _ in range(37)]
    other = [rng.randrange(3, VOCAB_SIZE) for _ in range(20)]
    suffixes = [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in (1, 3, 8, 13, 4)]
    shared = [system + s for s in suffixes]
    # The same prompt twice, a prefix of the system prompt, an unrelated prompt, and a
    # prompt that is exactly a whole number of blocks.
    return [*shared, list(shared[2]), system[:18], other, system[:36]]


@pytest.fixture(scope="module")
def references(tiny_llama_dir, prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    return [hf_greedy(model, p, MAX_NEW_TOKENS) for p in prompts]


SCHEDULES = {
    # all in one step: duplicates computed side by side, no hits yet within the step
    "together": dict(max_num_seqs=16),
    # one at a time: every later request hits the blocks of the earlier ones
    "one-at-a-time": dict(max_num_seqs=1),
    # a small budget: hits followed by chunked prefill from the middle of a prompt
    "chunks-after-hits": dict(max_num_seqs=3, max_num_batched_tokens=6),
    # a cache too small for all: preemption, eviction, re-admission hitting own blocks
    "tiny-cache": dict(max_num_seqs=4, num_kv_blocks=24),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_greedy_with_prefix_caching_matches_transformers(
    tiny_llama_dir, prompts, references, schedule
) -> None:
    llm = LLM(
        str(tiny_llama_dir), dtype="float32", block_size=BLOCK, record_trace=True,
        **SCHEDULES[schedule],
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    # Twice: the second round runs with the first round's blocks cached (or evicted).
    for round_ in range(2):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for i, (ref, out) in enumerate(zip(references, outputs, strict=True)):
            assert_matches_reference(out.outputs[0].token_ids, ref, f"{schedule} #{i} r{round_}")
            assert out.num_cached_tokens % BLOCK == 0
            assert out.num_cached_tokens <= BLOCK * ((len(prompts[i]) - 1) // BLOCK)
    kv = llm.llm_engine.kv_cache
    assert kv.pool.num_used_blocks == 0
    kv.check_invariants()
    hits = kv.prefix_stats.hits
    cached_in_trace = sum(e.num_cached_tokens for r in llm.step_trace.records for e in r.entries)
    assert cached_in_trace == hits > 0
    if schedule == "one-at-a-time":
        # Second round: every prompt finds all its full blocks but the last token's.
        assert [o.num_cached_tokens for o in outputs] == [
            BLOCK * ((len(p) - 1) // BLOCK) for p in prompts
        ]
    if schedule == "chunks-after-hits":
        by_request: dict[str, list] = {}
        for record in llm.step_trace.records:
            for entry in record.entries:
                by_request.setdefault(entry.request_id, []).append(entry)
        assert any(
            entries[0].num_cached_tokens and entries[1].kind == "prefill"
            for entries in by_request.values() if len(entries) > 1
        ), "no chunked prefill right after a hit"
    if schedule == "tiny-cache":
        assert llm.llm_engine.scheduler.num_preemptions > 0


def test_cached_and_uncached_requests_share_a_step(tiny_llama_dir, prompts, references) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", block_size=BLOCK, record_trace=True)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    outputs = llm.generate(
        [{"prompt_token_ids": prompts[1]}, {"prompt_token_ids": prompts[7]}], params,
        use_tqdm=False,
    )
    assert outputs[0].num_cached_tokens == 36 and outputs[1].num_cached_tokens == 0
    first_step = next(r for r in llm.step_trace.records if len(r.entries) == 2)
    assert sorted(e.num_cached_tokens for e in first_step.entries) == [0, 36]
    for out, ref in zip(outputs, (references[1], references[7]), strict=True):
        assert_matches_reference(out.outputs[0].token_ids, ref, "mixed step")


def test_cache_salt_and_switch_off(tiny_llama_dir, prompts) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm = LLM(str(tiny_llama_dir), dtype="float32", block_size=BLOCK)
    llm.generate([{"prompt_token_ids": prompts[0], "cache_salt": "a"}], params, use_tqdm=False)
    (other,) = llm.generate(
        [{"prompt_token_ids": prompts[0], "cache_salt": "b"}], params, use_tqdm=False
    )
    (same,) = llm.generate(
        [{"prompt_token_ids": prompts[0], "cache_salt": "a"}], params, use_tqdm=False
    )
    assert other.num_cached_tokens == 0 and same.num_cached_tokens == 36
    assert llm.reset_prefix_cache() is True
    (after_reset,) = llm.generate(
        [{"prompt_token_ids": prompts[0], "cache_salt": "a"}], params, use_tqdm=False
    )
    assert after_reset.num_cached_tokens == 0
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([{"prompt_token_ids": prompts[0], "cache_salt": ""}], params)

    off = LLM(str(tiny_llama_dir), dtype="float32", block_size=BLOCK, enable_prefix_caching=False)
    off.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    (again,) = off.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    assert again.num_cached_tokens == 0


def test_reset_is_refused_while_a_request_holds_blocks(tiny_llama_dir, prompts) -> None:
    from inflight.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_options(str(tiny_llama_dir), dtype="float32", block_size=BLOCK)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": prompts[0]}, params)
    engine.step()
    assert engine.reset_prefix_cache() is False
    assert engine.kv_cache.find_cached_prefix(
        engine.scheduler.requests["a"]
    ).num_tokens == 36  # nothing was forgotten
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.reset_prefix_cache() is True
    assert engine.kv_cache.pool.num_cached_blocks == 0
