"""LLM.beam_search on the default model equals vLLM's algorithm run on transformers.

The reference (helpers.reference.hf_beam_search) recomputes every beam from scratch on
transformers' float32 model of the same GGUF file, in float64 log-softmax; the engine runs
each beam as a one-token request with logprobs, its KV from the prefix cache. The chat
prompt's best beams end in EOS (the "stop" path), the raw ones run to max_tokens.
"""

from __future__ import annotations

import os

import pytest
import torch

from helpers.reference import hf_beam_search
from inflight import LLM, SamplingParams
from inflight.beam_search import BeamSearchParams
from inflight.model.loader import default_model_path

BEAM_WIDTH = 3
MAX_TOKENS = 10
# Schedules that change what each step computes, never the result.
SCHEDULES = {
    "prefix-cache": {},
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "tiny-kv-cache": dict(num_kv_blocks=24, block_size=8, max_num_seqs=4),
}


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32")


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False, add_generation_prompt=True,
    )
    return [tokenizer.encode(text) for text in (chat, "The quick brown fox", "def fibonacci(n):")]


@pytest.fixture(scope="module")
def references(hf_model, llm, prompts):
    eos = set(llm.llm_engine.eos_token_ids)
    refs = [hf_beam_search(hf_model, p, BEAM_WIDTH, MAX_TOKENS, eos) for p in prompts]
    for _, margin in refs:
        assert margin > 1e-4, f"a near-tie in the reference ({margin:.1e}): pick other prompts"
    assert any(b.finished_by_eos for b in refs[0][0]), "the chat prompt should reach EOS"
    return [beams for beams, _ in refs]


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_beam_search_matches_reference(llm, prompts, references, schedule):
    engine = llm if schedule == "prefix-cache" else LLM(dtype="float32", **SCHEDULES[schedule])
    params = BeamSearchParams(beam_width=BEAM_WIDTH, max_tokens=MAX_TOKENS)
    outputs = engine.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    tokenizer = engine.llm_engine.tokenizer
    for prompt, reference, output in zip(prompts, references, outputs, strict=True):
        assert [s.tokens for s in output.sequences] == [b.tokens for b in reference]
        for seq, ref in zip(output.sequences, reference, strict=True):
            assert seq.tokens[: len(prompt)] == prompt
            assert seq.cum_logprob == pytest.approx(ref.cum_logprob, abs=2e-3)
            assert seq.finish_reason == ("stop" if ref.finished_by_eos else "length")
            # prompt included and special tokens (a final EOS) left out, as in vLLM
            assert seq.text == tokenizer.decode(seq.tokens, skip_special_tokens=True)
            assert len(seq.logprobs) == len(seq.tokens) - len(prompt)
    kv = engine.llm_engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks or engine.llm_engine.config.cache.enable_prefix_caching


def test_width_one_without_eos_is_greedy(llm, prompts):
    greedy = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False,
    )
    beams = llm.beam_search(
        [{"prompt_token_ids": p} for p in prompts],
        BeamSearchParams(beam_width=1, max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    for prompt, g, b in zip(prompts, greedy, beams, strict=True):
        assert b.sequences[0].tokens == prompt + g.outputs[0].token_ids


def test_text_prompts_and_concurrency_limit_give_the_same_beams(llm):
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    texts = ["The quick brown fox", {"prompt": "def fibonacci(n):"}]
    together = llm.beam_search(texts, params)
    one_at_a_time = llm.beam_search(texts, params, concurrency_limit=1)
    assert [[s.tokens for s in o.sequences] for o in together] == [
        [s.tokens for s in o.sequences] for o in one_at_a_time
    ]
    assert together[0].sequences[0].text.startswith("The quick brown fox")


def test_skip_special_tokens_false_keeps_the_final_eos_in_the_text(llm, prompts):
    """vLLM's BeamSearchParams.skip_special_tokens (default True) decides the texts."""
    chat = [{"prompt_token_ids": prompts[0]}]
    eos_text = llm.get_tokenizer().decode(llm.llm_engine.eos_token_ids[:1])
    plain = llm.beam_search(chat, BeamSearchParams(beam_width=BEAM_WIDTH, max_tokens=MAX_TOKENS))
    kept = llm.beam_search(chat, BeamSearchParams(
        beam_width=BEAM_WIDTH, max_tokens=MAX_TOKENS, skip_special_tokens=False,
    ))
    stopped = [s for s in plain[0].sequences if s.finish_reason == "stop"]
    assert stopped, "the chat prompt's best beams reach EOS"
    for seq in stopped:
        assert not seq.text.endswith(eos_text) and "<|im_start|>" not in seq.text
    for seq in kept[0].sequences:
        assert seq.text == llm.get_tokenizer().decode(seq.tokens)
        assert seq.text.endswith(eos_text) == (seq.finish_reason == "stop")


@pytest.mark.parametrize(
    ("field", "value"),
    [("structured_outputs", {"choice": ["a", "b"]}), ("watermarking", True),
     ("skip_special_tokens", "yes")],
)
def test_vllm_fields_not_implemented_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(beam_width=2, max_tokens=2, **{field: value})


@pytest.mark.parametrize(
    ("prompts", "params", "error", "match"),
    [
        (["hi"], BeamSearchParams(beam_width=11, max_tokens=2), ValueError, "max_logprobs"),
        ([[]], BeamSearchParams(beam_width=2, max_tokens=2), ValueError, "empty"),
        ([[10**7]], BeamSearchParams(beam_width=2, max_tokens=2), ValueError, "vocab"),
        (["hi"], SamplingParams(max_tokens=2), TypeError, "BeamSearchParams"),
    ],
)
def test_bad_requests_fail_before_any_work(llm, prompts, params, error, match):
    with pytest.raises(error, match=match):
        llm.beam_search(prompts, params)
    # the engine is untouched and still serves
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
