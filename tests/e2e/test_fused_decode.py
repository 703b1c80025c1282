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


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_tiles_decode_stack_is_bit_identical(
    monkeypatch: pytest.MonkeyPatch, kv_cache_dtype: str
) -> None:
    """bfloat16 decode steps past the block kernel's rows (here 12 sequences) whose linears
    read 4-bit blocks on AMX tiles (or, with AVX512-BF16 and no AMX, bfloat16 pair tiles):
    one C++ call (DecodeStackTiles) against the modules."""
    from helpers.prompts import PROMPTS as ALL
    from inflight.model.fused_decode import FusedDecodeTiles

    if not (cpu_kernels.gguf_amx_linear_available() or cpu_kernels.bf16_linear_available()):
        pytest.skip("neither the 4-bit AMX linear nor the bfloat16 pair linear on this CPU")
    # Compute in bfloat16 even where start-up would pick float32 (an Intel Xeon without AMX,
    # whose bfloat16 dot products run at half the float32 FMA rate): the tiles are bfloat16.
    monkeypatch.setenv("INFLIGHT_BF16_MATMUL", "bf16")
    llm = LLM(dtype="bfloat16", kv_cache_dtype=kv_cache_dtype)
    model = llm.llm_engine.runner.model
    assert model.fused_decode_tiles is not None, "the default model's linears take the tiles"
    prompts = (ALL * 3)[:12]
    assert len(prompts) > model.block_max_rows
    calls = []
    real = FusedDecodeTiles.run
    monkeypatch.setattr(
        FusedDecodeTiles, "run", lambda *a: calls.append(1) or real(*a)  # type: ignore[func-returns-value]
    )

    def generate() -> list[tuple[list[int], list[dict[int, float]]]]:
        outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
        return [
            (list(o.outputs[0].token_ids),
             [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs or []])
            for o in outputs
        ]

    fused = generate()
    assert len(calls) >= PARAMS.max_tokens - 1  # every decode step of the 12
    model.fused_decode_tiles = None
    calls.clear()
    unfused = generate()
    assert not calls
    assert fused == unfused
