"""The float64 reference for the bfloat16 linear kernels (csrc/bf16_linear.cpp,
csrc/amx_linear.cpp) and their one-unit tolerance."""

from __future__ import annotations

import torch


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` in float64, rounded once to bfloat16."""
    return (x.double() @ w.double().T).to(torch.bfloat16)


def assert_within_one_ulp(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Products of bfloat16 values are exact in float32 and the kernels sum in float32:
    each output must be within one bfloat16 unit of the larger magnitude (plus float32
    summation) of the rounded float64 result."""
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    ulp = expected.float().abs().clamp_min(1e-3) * 2.0**-7
    diff = (got.float() - expected.float()).abs()
    assert (diff <= ulp).all(), f"max error {diff.max().item()} at {diff.argmax().item()}"
