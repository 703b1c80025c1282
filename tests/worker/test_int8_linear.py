"""The dynamic W8A8 int8 linear kernel (csrc/int8_linear.cpp) and SmoothQuant's factors.

The kernel's claim: y = float(xq @ wq.T) * x_scale * w_scale, with x (times the optional
column multipliers) quantised per row and the weight per output channel, symmetric,
round-half-even. The reference below computes exactly that in PyTorch (integer products
are exact), so the two must agree bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from inflight.kernels import cpu
from inflight.model.w8a8 import smoothing_factors

pytestmark = pytest.mark.skipif(not cpu.available(), reason="needs the C++ CPU kernels")


def quantize_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.abs().amax(dim=1)
    # torch.full_like(...) / amax, not 127.0 / amax (which PyTorch computes as a reciprocal
    # times 127, rounding twice)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(x * inv[:, None]).clamp(-127, 127).to(torch.int8)
    return q, amax / 127.0


def linear_reference(
    x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, mul: torch.Tensor | None = None
) -> torch.Tensor:
    xq, x_scale = quantize_reference(x if mul is None else x * mul)
    acc = (xq.long() @ wq.long().t()).float()  # exact: |sum| < 2**24
    return acc * x_scale[:, None] * w_scale[None, :]


def test_weight_quantisation_is_per_channel_symmetric():
    torch.manual_seed(0)
    w = torch.randn(96, 64) * torch.rand(96, 1) * 3
    w[5] = 0.0  # an all-zero row must not divide by zero
    wq, scale = cpu.int8_quantize_weight(w)
    assert wq.dtype == torch.int8 and wq.shape == w.shape and scale.shape == (96,)
    torch.testing.assert_close(scale, w.abs().amax(dim=1) / 127, rtol=0, atol=0)
    assert wq.abs().max() == 127 and wq[5].abs().max() == 0
    error = (wq.float() * scale[:, None] - w).abs()
    assert (error <= scale[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("rows", [1, 7, 33, 600, 1100])  # past the kernel's 512-row chunks
@pytest.mark.parametrize("smooth", [False, True])
def test_int8_linear_matches_the_reference_exactly(rows, smooth):
    torch.manual_seed(rows)
    x = torch.randn(rows, 192)
    x[0, 3] = 40.0  # an outlier column value
    if rows > 1:
        x[1] = 0.0  # an all-zero row
    w = torch.randn(80, 192)
    wq, w_scale = cpu.int8_quantize_weight(w)
    mul = torch.rand(192) + 0.5 if smooth else None
    y = cpu.int8_linear(x, wq, w_scale, mul)
    assert y.shape == (rows, 80) and y.dtype == torch.float32
    torch.testing.assert_close(y, linear_reference(x, wq, w_scale, mul), rtol=0, atol=0)
    exact = (x if mul is None else x * mul) @ (wq.float() * w_scale[:, None]).t()
    assert (y - exact).norm() / exact.norm() < 0.05  # int8 activations: 1-3% off here


def test_int8_linear_rejects_bad_shapes():
    wq, w_scale = cpu.int8_quantize_weight(torch.randn(8, 16))
    with pytest.raises(RuntimeError, match="K = 12"):
        cpu.int8_linear(torch.randn(4, 12), wq, w_scale)
    with pytest.raises(RuntimeError, match="smooth_inv"):
        cpu.int8_linear(torch.randn(4, 16), wq, w_scale, torch.ones(15))
    with pytest.raises(RuntimeError, match="w_scale"):  # strided: would read wrong scales
        cpu.int8_linear(torch.randn(4, 16), wq, torch.stack([w_scale, w_scale], 1)[:, 0])
    with pytest.raises(RuntimeError, match="w_scale"):
        cpu.int8_linear(torch.randn(4, 16), wq, w_scale[:, None])


def test_smoothing_leaves_the_product_unchanged_and_helps_an_outlier_column():
    torch.manual_seed(1)
    x = torch.randn(64, 128)
    x[:, 7] *= 60.0  # one outlier feature in every token, as in LLM activations
    w = torch.randn(256, 128) * 0.05
    s = smoothing_factors(x.abs().amax(dim=0), w, alpha=0.5)
    expected = (x.abs().amax(dim=0) ** 0.5) / (w.abs().amax(dim=0) ** 0.5)
    assert torch.equal(s, torch.exp2(torch.log2(s).round()))  # powers of two
    assert bool(((s / expected).log2().abs() <= 0.5 + 1e-6).all())  # the nearest ones
    exact = x.double() @ w.double().t()
    torch.testing.assert_close((x.double() / s.double()) @ (w.double() * s.double()).t(), exact)

    def relative_error(smooth: torch.Tensor | None) -> float:
        weight = w if smooth is None else w * smooth
        wq, w_scale = cpu.int8_quantize_weight(weight)
        mul = None if smooth is None else (1.0 / smooth).contiguous()
        y = cpu.int8_linear(x, wq, w_scale, mul).double()
        return float((y - exact).norm() / exact.norm())

    assert relative_error(s) < 0.5 * relative_error(None)
