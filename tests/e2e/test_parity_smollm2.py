"""Greedy outputs of the default model (SmolLM2-135M-Instruct GGUF) equal transformers'.

transformers reads the same GGUF file (dequantising it to float32), so both engines run
identical weights; any difference comes from the engine. Divergence is tolerated only at
a near-tie of the reference's top-2 logits (see helpers.reference).
"""

from __future__ import annotations

import os

import pytest
import torch

from helpers.reference import assert_matches_reference, hf_greedy
from inflight import LLM, SamplingParams
from inflight.kernels import cpu
from inflight.model.loader import default_model_path

MAX_NEW_TOKENS = 20
CHAT_QUESTIONS = ["What is the capital of France?", "Name three colours of the rainbow."]
RAW_PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "In 1492, Christopher Columbus",
    "Continuous batching schedules every step so that",
]


@pytest.fixture(scope="module")
def prompt_token_ids() -> list[list[int]]:
    from transformers import AutoTokenizer

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in CHAT_QUESTIONS
    ] + RAW_PROMPTS
    return [tokenizer.encode(p) for p in prompts]


@pytest.fixture(scope="module")
def references(prompt_token_ids):
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    return [hf_greedy(model, p, MAX_NEW_TOKENS) for p in prompt_token_ids]


SCHEDULES = {
    "one-at-a-time": dict(max_num_seqs=1),
    "all-at-once": dict(max_num_seqs=16),
    "tiny-kv-cache-preempts": dict(max_num_seqs=6, num_kv_blocks=12, block_size=8),
    "tiny-token-budget-chunks": dict(max_num_seqs=6, max_num_batched_tokens=10),
    # By default steps of up to 16-32 tokens read the GGUF blocks; this one keeps every step
    # on the dense float32 weights.
    "dense-weights-only": dict(max_num_seqs=16, quantization="none"),
    "prefix-caching-off": dict(max_num_seqs=16, enable_prefix_caching=False),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_default_model_greedy_matches_transformers(prompt_token_ids, references, schedule):
    llm = LLM(dtype="float32", record_trace=True, **SCHEDULES[schedule])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompt_token_ids], params, use_tqdm=False
    )
    for prompt, ref, out in zip(prompt_token_ids, references, outputs, strict=True):
        assert_matches_reference(out.outputs[0].token_ids, ref, f"{schedule} {prompt[:4]}...")
    records = llm.step_trace.records
    if schedule == "tiny-kv-cache-preempts":
        assert any(r.preempted for r in records), "the tiny cache was meant to force preemption"
    if schedule == "tiny-token-budget-chunks":
        assert all(r.num_batched_tokens <= 10 for r in records)
    if schedule == "dense-weights-only" and cpu.f32_linear_available():
        # steps of up to 256 tokens ran csrc/bf16_linear.cpp's float32 tile kernel
        layer = llm.llm_engine.runner.model.layers[0]
        assert layer.mlp.gate_up_proj.tiles32 is not None
        assert layer.mlp.gate_up_proj._own_choice(torch.zeros(100, 576)) == "tiles32"
    if schedule == "one-at-a-time":
        # The second chat prompt reuses the first's cached blocks (the template's system
        # prompt): prefix caching is on by default and leaves the tokens unchanged.
        assert outputs[1].num_cached_tokens >= 16
    if schedule == "prefix-caching-off":
        assert all(o.num_cached_tokens == 0 for o in outputs)


def test_chat_answers_paris():
    llm = LLM()
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=16),
        use_tqdm=False,
    )[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # the model ends its answer with EOS
