"""The bfloat16 pair-tile linear (csrc/bf16_linear.cpp) against a float64 reference.

Products of bfloat16 values are exact in float32 and the kernel sums in float32, so each
output is the exact dot product to float32's accumulated rounding, then rounded once to
bfloat16: it must be the float64 result rounded to bfloat16, give or take one unit in the
last place. A wrong pair order, tile offset or row slice errs by whole values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inflight.kernels import cpu
from inflight.model.linear import Linear
from tests.helpers.bf16_matmul import assert_within_one_ulp, reference

pytestmark = pytest.mark.skipif(
    not cpu.bf16_linear_available(), reason="the bf16 linear kernel needs AVX512-BF16"
)



@pytest.mark.parametrize("n,k", [(16, 2), (48, 64), (80, 96), (960, 576), (576, 1536)])
@pytest.mark.parametrize("m", [1, 5, 6, 7, 13, 57])
def test_matches_float64_reference(m, n, k):
    torch.manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k).bfloat16()
    w = torch.randn(n, k).bfloat16()
    got = cpu.bf16_linear(x, cpu.bf16_pack_pairs(w), n)
    assert_within_one_ulp(got, reference(x, w))


@pytest.mark.parametrize("n", [80, 208, 576, 960])
@pytest.mark.parametrize("threads", [2, 3])
def test_columns_split_between_threads_inside_a_tile_give_the_same_bits(n, threads):
    """Threads take equal runs of 16-column blocks, so a run may start or end inside a
    64-column tile (576 columns on 2 threads: 4.5 tiles each). Every output column must
    come out bit for bit as one thread computes it, and each split column must still be
    the product with its own weight row."""
    torch.manual_seed(n + threads)
    k = 96
    x = torch.randn(13, k).bfloat16()
    w = torch.randn(n, k).bfloat16()
    packed = cpu.bf16_pack_pairs(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = cpu.bf16_linear(x, packed, n, float32_out=True)
        torch.set_num_threads(threads)
        split = cpu.bf16_linear(x, packed, n, float32_out=True)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(split, alone)
    assert_within_one_ulp(split.bfloat16(), reference(x, w))


@pytest.mark.parametrize("m", [1, 6, 13])
def test_float32_out_is_the_unrounded_sum(m):
    """float32_out (the output layer's logits): float32, within float32 summation error of
    the float64 product (far inside a bfloat16 unit), and the bfloat16 output is exactly
    it rounded."""
    torch.manual_seed(m)
    n, k = 960, 576
    x = torch.randn(m, k).bfloat16()
    w = torch.randn(n, k).bfloat16()
    packed = cpu.bf16_pack_pairs(w)
    got = cpu.bf16_linear(x, packed, n, float32_out=True)
    exact = x.double() @ w.double().T
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert ((got.double() - exact).abs() <= exact.abs() * 2.0**-16 + 1e-4).all()
    assert torch.equal(cpu.bf16_linear(x, packed, n), got.bfloat16())


def test_logits_are_not_rounded_to_bfloat16():
    """compute_logits' path: a bf16 output layer within the kernel's rows gives float32
    logits that are not all bfloat16 values (rounded ones tie, and argmax takes the
    lowest tied id)."""
    torch.manual_seed(0)
    layer = Linear(576, 4096, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(4096, 576) * 0.05)
    layer.to(torch.bfloat16)
    layer.use_pair_weight(256)
    hidden = torch.randn(20, 576).bfloat16()
    logits = layer.forward_float32(hidden)
    assert logits.dtype == torch.float32
    assert not torch.equal(logits, logits.bfloat16().float())
    torch.testing.assert_close(logits, (hidden.double() @ layer.weight.double().T).float(),
                               rtol=1e-5, atol=1e-4)


def test_each_output_column_reads_its_own_weight_row():
    """Weight row n = e_n (one-hot, repeated past K): y[:, n] must be x[:, n % K] exactly,
    so a column read from the wrong tile or pair shows up as a different input."""
    n, k = 80, 32
    w = torch.zeros(n, k, dtype=torch.bfloat16)
    w[torch.arange(n), torch.arange(n) % k] = 1
    x = torch.randn(9, k).bfloat16()
    got = cpu.bf16_linear(x, cpu.bf16_pack_pairs(w), n)
    assert torch.equal(got, x[:, torch.arange(n) % k])


def test_linear_module_uses_the_kernel_within_its_rows_and_onednn_past_them():
    torch.manual_seed(0)
    layer = Linear(576, 960)
    layer.weight.data = torch.randn(960, 576).bfloat16()
    layer.use_packed_weight()
    layer.use_pair_weight(max_rows=32)
    assert layer.pairs is not None
    for m in (9, 32, 33, 64):
        x = torch.randn(m, 576).bfloat16()
        assert_within_one_ulp(layer(x), reference(x, layer.weight))
    # a layer the kernel does not take keeps oneDNN
    odd = Linear(576, 100)
    odd.weight.data = torch.randn(100, 576).bfloat16()
    odd.use_pair_weight(max_rows=32)
    assert odd.pairs is None
    x = torch.randn(4, 576).bfloat16()
    torch.testing.assert_close(odd(x), F.linear(x, odd.weight))


def test_bad_shapes_are_refused_with_their_sizes():
    with pytest.raises(RuntimeError, match="multiple of 16"):
        cpu.bf16_pack_pairs(torch.zeros(20, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu.bf16_pack_pairs(torch.zeros(16, 8))
    packed = cpu.bf16_pack_pairs(torch.zeros(32, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="needs"):
        cpu.bf16_linear(torch.zeros(2, 16, dtype=torch.bfloat16), packed, 32)
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu.bf16_linear(torch.zeros(2, 8), packed, 32)


def test_the_kernel_is_chosen_only_without_amx_and_unless_turned_off(monkeypatch):
    from inflight.worker import device

    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert device.pair_matmul_rows() == device.PAIR_MATMUL_MAX_ROWS
    monkeypatch.setenv("INFLIGHT_BF16_LINEAR", "onednn")
    assert device.pair_matmul_rows() == 0
    monkeypatch.delenv("INFLIGHT_BF16_LINEAR")
    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_bf16"}))
    assert device.pair_matmul_rows() == 0  # oneDNN's AMX tiles are far faster
