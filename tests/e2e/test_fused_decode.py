"""The one-call decode stack (csrc/decode_layer.cpp) runs the same kernels in the same
order as the Python modules: outputs and log-probabilities are bit-identical with it on
and off, and it does run for the decode steps of the default model (GGUF blocks)."""

from __future__ import annotations

import pytest

from helpers.prompts import PROMPTS
from inflight import LLM, SamplingParams
from inflight.kernels import cpu as cpu_kernels
from inflight.model.fused_decode import FusedDecode

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)


def run(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    outputs = llm.generate(PROMPTS[:4], PARAMS, use_tqdm=False)
    result = []
    for output in outputs:
        completion = output.outputs[0]
        assert completion.logprobs is not None
        logprobs = [{t: lp.logprob for t, lp in step.items()} for step in completion.logprobs]
        result.append((list(completion.token_ids), logprobs))
    return result


@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype"), [("float32", "auto"), ("bfloat16", "int8")]
)
def test_fused_decode_is_bit_identical(
    monkeypatch: pytest.MonkeyPatch, dtype: str, kv_cache_dtype: str
) -> None:
    if not cpu_kernels.gguf_matmul_available():
        pytest.skip("no GGUF block kernel on this CPU")
    llm = LLM(dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    model = llm.llm_engine.runner.model
    assert model.fused_decode is not None, "the default model's layers read GGUF blocks"
    calls = []
    real = FusedDecode.run
    monkeypatch.setattr(
        FusedDecode, "run", lambda *a: calls.append(1) or real(*a)  # type: ignore[func-returns-value]
    )
    fused = run(llm)
    assert len(calls) >= PARAMS.max_tokens - 1  # every decode step
    model.fused_decode = None  # the layer-by-layer Python path
    calls.clear()
    unfused = run(llm)
    assert not calls
    assert fused == unfused
