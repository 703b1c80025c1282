"""The matmul dtype for bfloat16 weights: forced by INFLIGHT_BF16_MATMUL, else timed; other
dtypes and devices are never changed. Weights rounded to bf16 keep their bf16 values."""

from __future__ import annotations

import pytest
import torch

from inflight.worker.device import pick_matmul_dtype


@pytest.mark.parametrize(("forced", "expected"), [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_forced_choice(monkeypatch: pytest.MonkeyPatch, forced: str, expected: torch.dtype) -> None:
    monkeypatch.setenv("INFLIGHT_BF16_MATMUL", forced)
    assert pick_matmul_dtype(torch.bfloat16, torch.device("cpu"), 64, 128) == expected


def test_other_dtypes_and_devices_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFLIGHT_BF16_MATMUL", "fp32")
    assert pick_matmul_dtype(torch.float32, torch.device("cpu"), 64, 128) == torch.float32
    assert pick_matmul_dtype(torch.bfloat16, torch.device("meta"), 64, 128) == torch.bfloat16


def test_bad_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFLIGHT_BF16_MATMUL", "fast")
    with pytest.raises(ValueError, match="INFLIGHT_BF16_MATMUL"):
        pick_matmul_dtype(torch.bfloat16, torch.device("cpu"), 64, 128)


def test_auto_returns_one_of_the_two(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INFLIGHT_BF16_MATMUL", raising=False)
    assert pick_matmul_dtype(torch.bfloat16, torch.device("cpu"), 64, 128) in (
        torch.bfloat16, torch.float32,
    )


def test_float32_compute_of_bf16_weights_matches_bf16_rounded_model(
    monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: object
) -> None:
    """Forced float32 compute holds exactly the bf16-rounded weights (so the precision the
    user asked for), only computed in float32."""
    from inflight.engine.llm_engine import LLMEngine

    monkeypatch.setenv("INFLIGHT_BF16_MATMUL", "fp32")
    engine = LLMEngine.from_options(str(tiny_llama_dir), dtype="bfloat16")
    assert engine.matmul_dtype == torch.float32
    assert engine.runner.kv_caches[0].k.dtype == torch.bfloat16  # the KV cache stays bf16
    weight = engine.runner.model.layers[0].mlp.down_proj.weight
    assert weight.dtype == torch.float32
    assert torch.equal(weight, weight.bfloat16().float())  # every value is a bf16 value
