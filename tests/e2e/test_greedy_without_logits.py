"""Greedy steps take their tokens straight from the output layer's kernel (the argmax fused
into csrc/amx_linear.cpp, or csrc/bf16_linear.cpp without AMX, the logits never written):
the same tokens as the sampler's argmax over the logits, and only where every row is plain
greedy sampling."""

from __future__ import annotations

import pytest

from helpers.prompts import PROMPTS
from inflight import LLM, SamplingParams
from inflight.kernels import cpu as cpu_kernels
from inflight.model.llama import LlamaForCausalLM

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    if not (cpu_kernels.amx_linear_available() or cpu_kernels.bf16_linear_available()):
        pytest.skip("the fused argmax needs the AMX linear or the bfloat16 pair linear")
    # Compute in bfloat16 even where start-up would pick float32 (an Intel Xeon without AMX,
    # whose bfloat16 dot products run at half the float32 FMA rate): the kernels are bfloat16.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("INFLIGHT_BF16_MATMUL", "bf16")
        return LLM(dtype="bfloat16")


def token_ids(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[list[int]]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def count_fused(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows whose tokens came from the fused argmax, appended per call that fused."""
    fused: list[int] = []
    real = LlamaForCausalLM.greedy_tokens

    def spy(self: LlamaForCausalLM, hidden):  # type: ignore[no-untyped-def]
        ids = real(self, hidden)
        if ids is not None:
            fused.append(len(ids))
        return ids

    monkeypatch.setattr(LlamaForCausalLM, "greedy_tokens", spy)
    return fused


def test_fused_greedy_tokens_equal_the_sampler_argmax(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = (PROMPTS * 4)[:20]  # steps of 20 rows: bfloat16 activations, AMX or pair kernel
    fused = count_fused(monkeypatch)
    with_fusion = token_ids(llm, prompts, [GREEDY] * len(prompts))
    assert sum(fused) >= len(prompts) * (GREEDY.max_tokens - 2)
    monkeypatch.setattr(LlamaForCausalLM, "greedy_tokens", lambda self, hidden: None)
    assert token_ids(llm, prompts, [GREEDY] * len(prompts)) == with_fusion


@pytest.mark.parametrize(
    "odd_one",
    [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=16, min_tokens=8),
        SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=7),
    ],
    ids=["logprobs", "penalty", "min_tokens", "random"],
)
def test_a_row_that_needs_its_logits_keeps_the_sampler(
    llm: LLM, monkeypatch: pytest.MonkeyPatch, odd_one: SamplingParams
) -> None:
    """One row with logprobs, a penalty, min_tokens or temperature in the batch: those
    steps go through the logits and the sampler, and the greedy rows' tokens are the same
    as when they run alone."""
    prompts = (PROMPTS * 4)[:20]
    alone = token_ids(llm, prompts[1:], [GREEDY] * (len(prompts) - 1))
    fused = count_fused(monkeypatch)
    mixed = token_ids(llm, prompts, [odd_one] + [GREEDY] * (len(prompts) - 1))
    assert mixed[1:] == alone
    # Only steps after the odd request finished (min_tokens: after its 8th token, when
    # nothing is suppressed any more) may fuse; while it runs, none does.
    assert sum(fused) <= (len(prompts) - 1) * GREEDY.max_tokens
    assert all(rows < len(prompts) for rows in fused) or odd_one.min_tokens
