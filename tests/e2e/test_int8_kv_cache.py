"""The int8 KV cache (``kv_cache_dtype="int8"``) on the default model.

Quantising K/V changes attention slightly, so the claim against float32 is the same as
bfloat16's: most prompts agree on their first greedy tokens. Against itself the int8 cache
is nearly exact: a token's K/V quantise to the same bytes whenever they are written, so
preemption (recompute) and chunked prefill change nothing except where a different batch
shape rounds a float32 matmul differently and that flips an int8 rounding (seen once:
token 15 of one prompt, at a near-tie). A lost or misplaced scale would break every
prompt within a few tokens.
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


@pytest.mark.parametrize("schedule", [
    dict(max_num_seqs=6, num_kv_blocks=8, block_size=8),  # preempts and recomputes
    dict(max_num_seqs=6, max_num_batched_tokens=5),  # prompts in chunks of <= 5 tokens
])
def test_int8_cache_is_unchanged_by_preemption_and_chunking(schedule):
    base = dict(dtype="float32", kv_cache_dtype="int8", quantization="none")
    one_at_a_time = token_ids(max_num_seqs=1, **base)
    scheduled = token_ids(**schedule, **base)
    for expected, got in zip(one_at_a_time, scheduled, strict=True):
        assert got[:8] == expected[:8]
    assert sum(a == b for a, b in zip(one_at_a_time, scheduled, strict=True)) >= len(PROMPTS) - 1


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
