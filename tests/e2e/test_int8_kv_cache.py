"""The int8 KV cache (``kv_cache_dtype="int8"``) on the default model.

Quantising K/V changes attention slightly, so the claim against float32 is the same as
bfloat16's: most prompts agree on their first greedy tokens. Against itself the int8 cache
is nearly exact: a token's K/V quantise to the same bytes whenever they are written, so
preemption (recompute) changes little. Chunked prefill changes a little more: a fresh
prompt attends to its own exact K/V, a continued chunk to the int8 copies of the earlier
chunks, with its queries rounded to int8 steps where the CPU scores keys with int8 dot
products. So a schedule may flip a greedy token only at a near-tie of the one-at-a-time
run (seen: token 0 of "import numpy as np" on an AMD EPYC Zen 4, top two 0.10 nats apart;
token 15 of another prompt, 0.09 apart). A lost or misplaced scale would break every prompt
within a few tokens, at margins far wider than that.
"""

from __future__ import annotations

import pytest

from helpers.prompts import PROMPTS
from inflight import LLM, SamplingParams

TOKENS = 16
PARAMS = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)


def token_ids(**options) -> list[list[int]]:
    outputs = LLM(**options).generate(PROMPTS, PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_cache_agrees_with_fp32_on_most_prompts(dtype):
    fp32 = token_ids(dtype="float32")
    int8 = token_ids(dtype=dtype, kv_cache_dtype="int8")
    agree = sum(a == b for a, b in zip(fp32, int8, strict=True))
    assert agree >= len(PROMPTS) // 2 + 1, f"only {agree}/{len(PROMPTS)} agree on {TOKENS} tokens"


# A greedy token may differ between two schedules of the int8 cache only where the
# reference's top two log-probabilities are closer than this (nats).
NEAR_TIE = 0.25


@pytest.mark.parametrize("schedule", [
    dict(max_num_seqs=6, num_kv_blocks=8, block_size=8),  # preempts and recomputes
    dict(max_num_seqs=6, max_num_batched_tokens=5),  # prompts in chunks of <= 5 tokens
])
def test_int8_cache_is_unchanged_by_preemption_and_chunking(schedule):
    base = dict(dtype="float32", kv_cache_dtype="int8", quantization="none")
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, logprobs=2)
    one_at_a_time = LLM(max_num_seqs=1, **base).generate(PROMPTS, params, use_tqdm=False)
    scheduled = LLM(**schedule, **base).generate(PROMPTS, params, use_tqdm=False)
    agree = 0
    for prompt, expected, got in zip(PROMPTS, one_at_a_time, scheduled, strict=True):
        want, have = list(expected.outputs[0].token_ids), list(got.outputs[0].token_ids)
        if want == have:
            agree += 1
            continue
        first = next(i for i, (a, b) in enumerate(zip(want, have, strict=True)) if a != b)
        top = sorted((p.logprob for p in expected.outputs[0].logprobs[first].values()),
                     reverse=True)
        assert top[0] - top[1] < NEAR_TIE, (
            f"{prompt!r}: token {first} differs ({have[first]} for {want[first]}) where the "
            f"one-at-a-time run's top two were {top[0] - top[1]:.3f} nats apart"
        )
    assert agree >= len(PROMPTS) - 2, f"only {agree}/{len(PROMPTS)} agree on {TOKENS} tokens"


def test_int8_cache_halves_the_cache_bytes_per_block():
    import torch

    from inflight.model.loader import default_model_path, load_checkpoint
    from inflight.worker.kv_cache import bytes_per_block

    arch = load_checkpoint(default_model_path()).arch
    bf16 = bytes_per_block(arch, 16, torch.bfloat16)
    int8 = bytes_per_block(arch, 16, torch.int8)
    # 64 int8 values and one float32 scale per head and token, against 64 bfloat16 values
    assert int8 / bf16 == (arch.head_dim + 4) / (2 * arch.head_dim)


def test_bad_kv_cache_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(kv_cache_dtype="fp4")
