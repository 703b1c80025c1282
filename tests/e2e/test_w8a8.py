"""``quantization="w8a8"`` on the default model: int8 decoder linears with SmoothQuant.

W8A8 changes the arithmetic (int8 activations), so its claim is statistical: under teacher
forcing on float32's own greedy continuations, its top-1 token is float32's at most
positions (measured 93.6% on 40 chat prompts, README "W8A8"; bfloat16 weights: 99.7%). A
missing or inverted smoothing factor, a wrong scale, or a linear left unquantised or
quantised twice shows up as far lower agreement or in the checks on the modules.
"""

from __future__ import annotations

import pytest
import torch

from helpers.prompts import PROMPTS
from inflight import LLM, SamplingParams
from inflight.kernels import cpu
from inflight.model.w8a8 import check_supported

pytestmark = pytest.mark.skipif(not cpu.available(), reason="needs the C++ CPU kernels")
TOKENS = 24


def teacher_forced_agreement(llm: LLM, prompt_ids: list[list[int]], continuations) -> float:
    prompts = [{"prompt_token_ids": p + c} for p, c in zip(prompt_ids, continuations, strict=True)]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    agree = total = 0
    for output, continuation in zip(outputs, continuations, strict=True):
        for token, ranked in zip(continuation, output.prompt_logprobs[-len(continuation):],
                                 strict=True):
            best = max(ranked.items(), key=lambda item: item[1].logprob)[0]
            agree += best == token
            total += 1
    return agree / total


@pytest.fixture(scope="module")
def fp32_reference():
    llm = LLM(dtype="float32")
    outputs = llm.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    return [list(o.prompt_token_ids) for o in outputs], [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def w8a8_llm():
    return LLM(dtype="bfloat16", quantization="w8a8")


def test_w8a8_quantises_every_decoder_linear_and_not_the_output_layer(w8a8_llm):
    model = w8a8_llm.llm_engine.runner.model
    linears = [layer.self_attn.qkv_proj for layer in model.layers]
    linears += [layer.self_attn.o_proj for layer in model.layers]
    linears += [layer.mlp.gate_up_proj for layer in model.layers]
    linears += [layer.mlp.down_proj for layer in model.layers]
    for linear in linears:
        assert linear.int8 is not None and linear.packed is None
        wq, w_scale, smooth_inv = linear.int8
        assert wq.dtype == torch.int8 and wq.shape == linear.weight.shape
        # smoothed from the calibration texts: every column has its own factor
        assert smooth_inv is not None and smooth_inv.shape == (linear.weight.shape[1],)
        assert bool((smooth_inv > 0).all()) and float(smooth_inv.std()) > 0
        # the dense copy is freed: one element stands for it (its shape and dtype stay)
        assert linear.weight.untyped_storage().nbytes() <= 4
    assert model.lm_head.int8 is None


def test_calibration_leaves_the_engine_idle_and_its_cache_empty(w8a8_llm):
    engine = w8a8_llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert engine.kv_cache.prefix_stats.queries == 0


def test_w8a8_top1_agrees_with_fp32_under_teacher_forcing(w8a8_llm, fp32_reference):
    prompt_ids, continuations = fp32_reference
    agreement = teacher_forced_agreement(w8a8_llm, prompt_ids, continuations)
    assert agreement >= 0.85, f"top-1 agreement with float32 only {agreement:.1%}"


def test_smoothing_factors_do_not_depend_on_the_engine_options(w8a8_llm):
    # a budget that would have split the four calibration texts over other steps
    other = LLM(dtype="bfloat16", quantization="w8a8", max_num_batched_tokens=64, max_num_seqs=2)
    ours = w8a8_llm.llm_engine.runner.model.layers
    theirs = other.llm_engine.runner.model.layers
    for a, b in zip(ours.modules(), theirs.modules(), strict=True):
        if getattr(a, "int8", None) is not None:
            assert torch.equal(a.int8[2], b.int8[2]) and torch.equal(a.int8[0], b.int8[0])


def test_w8a8_off_the_cpu_is_a_clear_error():
    with pytest.raises(ValueError, match="quantization='w8a8' runs on the CPU"):
        check_supported(torch.device("cuda"))


def test_w8a8_without_the_kernels_is_a_clear_error_before_loading(monkeypatch):
    monkeypatch.setenv("INFLIGHT_ATTENTION_BACKEND", "torch")
    cpu.available.cache_clear()
    try:
        with pytest.raises(ValueError, match="INFLIGHT_ATTENTION_BACKEND=torch"):
            LLM(quantization="w8a8", model="/nonexistent/model")  # fails before loading it
    finally:
        monkeypatch.delenv("INFLIGHT_ATTENTION_BACKEND")
        cpu.available.cache_clear()
