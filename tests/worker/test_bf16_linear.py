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


# ---------------------------------------------------------------- fused greedy argmax

@pytest.mark.parametrize("m", [1, 5, 6, 7, 57, 200])
@pytest.mark.parametrize("n", [64, 4096, 49152])
def test_fused_argmax_is_the_argmax_of_the_float32_logits(m, n, two_threads):
    """bf16_linear_argmax: exactly bf16_linear(float32_out) then max(dim=-1).indices, for
    slice tails (rows not a multiple of 6), both threads' column runs and the output
    layer's width."""
    torch.manual_seed(m + n)
    x = torch.randn(m, 576).bfloat16()
    packed = cpu.bf16_pack_pairs((torch.randn(n, 576) * 0.05).bfloat16())
    expected = cpu.bf16_linear(x, packed, n, float32_out=True).max(dim=-1).indices
    assert torch.equal(cpu.bf16_linear_argmax(x, packed, n), expected)


def test_fused_argmax_takes_the_lowest_index_of_a_tie(two_threads):
    """Weight rows repeated at columns 21 and 5 (the same lane, 16 apart: 5 must stay),
    40 (another lane of the next tile) and 4090 (the other thread's columns): the tied
    maximum must come out as 5, as torch.max gives it; with column 5 zeroed, 21; with 21
    zeroed too, 40."""
    n, k = 4096, 64
    torch.manual_seed(1)
    w = torch.randn(n, k).bfloat16() * 0.01
    x = torch.randn(24, k).bfloat16()
    top = x[0].clone()  # a weight row aligned with row 0 wins it everywhere it appears
    for column in (5, 21, 40, 4090):
        w[column] = top
    assert cpu.bf16_linear_argmax(x, cpu.bf16_pack_pairs(w), n)[0] == 5
    for zeroed, then in ((5, 21), (21, 40), (40, 4090)):
        w[zeroed] = 0
        got = cpu.bf16_linear_argmax(x, cpu.bf16_pack_pairs(w), n)
        assert got[0] == then
        logits = cpu.bf16_linear(x, cpu.bf16_pack_pairs(w), n, True)
        assert torch.equal(got, logits.max(dim=-1).indices)


def test_fused_argmax_marks_nan_and_minus_infinity_rows(two_threads):
    """A row whose sums hold a NaN, or are all -inf, comes back -1 (the caller takes it
    from the logits); the other rows keep their tokens."""
    torch.manual_seed(2)
    x = torch.randn(20, 64).bfloat16()
    x[3, 7] = float("nan")
    x[8] = 0
    x[8, 0] = float("-inf")
    w = torch.randn(128, 64).bfloat16().abs() + 0.01  # row 8: -inf in every column
    packed = cpu.bf16_pack_pairs(w)
    got = cpu.bf16_linear_argmax(x, packed, 128)
    assert got[3] == -1 and got[8] == -1
    rest = [r for r in range(20) if r not in (3, 8)]
    logits = cpu.bf16_linear(x, packed, 128, True)
    assert torch.equal(got[rest], logits[rest].max(dim=-1).indices)


def test_linear_fuses_the_argmax_where_it_runs_the_pair_kernel():
    torch.manual_seed(3)
    layer = Linear(576, 4096)
    layer.weight.data = torch.randn(4096, 576).bfloat16()
    layer.use_pair_weight(max_rows=32)
    x = torch.randn(20, 576).bfloat16()
    assert torch.equal(layer.greedy_argmax(x), layer.forward_float32(x).max(dim=-1).indices)
    assert layer.greedy_argmax(torch.randn(33, 576).bfloat16()) is None  # past its rows
    assert layer.greedy_argmax(torch.randn(20, 576)) is None  # float32 activations
