"""The AMX tile linear (csrc/amx_linear.cpp) against a float64 reference.

Products of bfloat16 values are exact in float32 and the tiles sum in float32, so each
output is the exact dot product to float32's accumulated rounding, then rounded once to
bfloat16: within one bfloat16 unit of the float64 result. A wrong pair order, tile offset,
strip, row block or padding row errs by whole values. Skipped where the CPU or the OS
gives no AMX tiles (the kernel is then never chosen)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inflight.kernels import cpu
from inflight.model.linear import Linear
from tests.helpers.bf16_matmul import assert_within_one_ulp, reference

pytestmark = pytest.mark.skipif(
    not cpu.amx_linear_available(), reason="the AMX linear needs AMX tiles (amx_bf16)"
)



# Rows: a lone row, tails of one and two tiles (15, 17, 31, 33), 57 (mixed's mean batch),
# a whole row block (64), and more than the 32-row blocks a strip pair takes at once.
@pytest.mark.parametrize("n,k", [(32, 32), (96, 64), (960, 576), (576, 1536)])
@pytest.mark.parametrize("m", [1, 15, 16, 17, 31, 33, 57, 64, 300])
def test_matches_float64_reference(m, n, k):
    torch.manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k).bfloat16()
    w = torch.randn(n, k).bfloat16()
    got = cpu.amx_linear(x, cpu.amx_pack(w), n)
    assert_within_one_ulp(got, reference(x, w))


@pytest.mark.parametrize("m", [1, 20, 57])
def test_float32_out_is_the_unrounded_sum(m):
    """float32_out (the output layer's logits): within float32 summation error of the
    float64 product, and the bfloat16 output is exactly it rounded."""
    torch.manual_seed(m)
    n, k = 4096, 576
    x = torch.randn(m, k).bfloat16()
    w = torch.randn(n, k).bfloat16()
    packed = cpu.amx_pack(w)
    got = cpu.amx_linear(x, packed, n, float32_out=True)
    exact = x.double() @ w.double().T
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert ((got.double() - exact).abs() <= exact.abs() * 2.0**-16 + 1e-4).all()
    assert torch.equal(cpu.amx_linear(x, packed, n), got.bfloat16())


def test_each_output_column_reads_its_own_weight_row():
    """Weight row n = e_(n % K): y[:, n] must be x[:, n % K] exactly, so a column read from
    the wrong strip, tile or pair shows up as a different input; rows past a tile's 16
    (here 21 rows) must not leak into the valid ones."""
    n, k = 96, 64
    w = torch.zeros(n, k, dtype=torch.bfloat16)
    w[torch.arange(n), torch.arange(n) % k] = 1
    x = torch.randn(21, k).bfloat16()
    got = cpu.amx_linear(x, cpu.amx_pack(w), n)
    assert torch.equal(got, x[:, torch.arange(n) % k])


def test_linear_module_uses_the_kernel_within_its_rows_and_onednn_past_them():
    torch.manual_seed(0)
    layer = Linear(576, 960)
    layer.weight.data = torch.randn(960, 576).bfloat16()
    layer.use_packed_weight()
    layer.use_amx_weight(max_rows=32)
    assert layer.amx is not None
    for m in (9, 32, 33, 64):
        x = torch.randn(m, 576).bfloat16()
        assert_within_one_ulp(layer(x), reference(x, layer.weight))
    logits = layer.forward_float32(torch.randn(20, 576).bfloat16())
    assert logits.dtype == torch.float32
    assert not torch.equal(logits, logits.bfloat16().float())  # not rounded to bfloat16
    # a layer the kernel does not take keeps oneDNN
    odd = Linear(576, 100)
    odd.weight.data = torch.randn(100, 576).bfloat16()
    odd.use_amx_weight(max_rows=32)
    assert odd.amx is None
    x = torch.randn(4, 576).bfloat16()
    torch.testing.assert_close(odd(x), F.linear(x, odd.weight))


def test_bad_shapes_are_refused_with_their_sizes():
    with pytest.raises(RuntimeError, match="multiples of 32"):
        cpu.amx_pack(torch.zeros(48, 32, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu.amx_pack(torch.zeros(32, 32))
    packed = cpu.amx_pack(torch.zeros(32, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="needs"):
        cpu.amx_linear(torch.zeros(2, 32, dtype=torch.bfloat16), packed, 32)
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu.amx_linear(torch.zeros(2, 64), packed, 32)


def test_the_kernel_is_chosen_only_with_amx_and_unless_turned_off(monkeypatch):
    from inflight.worker import device

    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_bf16"}))
    assert device.amx_matmul_rows() == device.AMX_MATMUL_MAX_ROWS
    assert device.pair_matmul_rows() == 0
    monkeypatch.setenv("INFLIGHT_BF16_LINEAR", "onednn")
    assert device.amx_matmul_rows() == 0
    monkeypatch.delenv("INFLIGHT_BF16_LINEAR")
    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert device.amx_matmul_rows() == 0


# ---------------------------------------------------------------- fused greedy argmax

@pytest.mark.parametrize("m", [1, 15, 16, 17, 33, 57, 200])
@pytest.mark.parametrize("n", [64, 4096, 49152])
def test_fused_argmax_is_the_argmax_of_the_float32_logits(m, n, two_threads):
    """amx_linear_argmax: exactly amx_linear(float32_out) then max(dim=-1).indices, for
    row tails, both threads' column ranges and the output layer's width."""
    torch.manual_seed(m + n)
    x = torch.randn(m, 576).bfloat16()
    packed = cpu.amx_pack((torch.randn(n, 576) * 0.05).bfloat16())
    expected = cpu.amx_linear(x, packed, n, float32_out=True).max(dim=-1).indices
    assert torch.equal(cpu.amx_linear_argmax(x, packed, n), expected)


def test_fused_argmax_takes_the_lowest_index_of_a_tie(two_threads):
    """Weight rows repeated at columns 5, 21 (the other strip of the pair), 40 (the next
    pair) and 4090 (the other thread's columns): the tied maximum must come out as 5, as
    torch.max gives it; with column 5 zeroed, 21."""
    n, k = 4096, 64
    torch.manual_seed(1)
    w = torch.randn(n, k).bfloat16() * 0.01
    x = torch.randn(24, k).bfloat16()
    top = x[0].clone()  # a weight row aligned with row 0 wins it everywhere it appears
    for column in (5, 21, 40, 4090):
        w[column] = top
    got = cpu.amx_linear_argmax(x, cpu.amx_pack(w), n)
    assert got[0] == 5
    w[5] = 0
    got = cpu.amx_linear_argmax(x, cpu.amx_pack(w), n)
    assert got[0] == 21
    assert torch.equal(got, cpu.amx_linear(x, cpu.amx_pack(w), n, True).max(dim=-1).indices)


def test_fused_argmax_marks_a_nan_row(two_threads):
    """A row whose sums hold a NaN comes back -1 (the caller takes it from the logits);
    the other rows keep their tokens."""
    torch.manual_seed(2)
    x = torch.randn(20, 64).bfloat16()
    x[3, 7] = float("nan")
    w = torch.randn(128, 64).bfloat16()
    packed = cpu.amx_pack(w)
    got = cpu.amx_linear_argmax(x, packed, 128)
    assert got[3] == -1
    rest = [r for r in range(20) if r != 3]
    logits = cpu.amx_linear(x, packed, 128, True)
    assert torch.equal(got[rest], logits[rest].max(dim=-1).indices)


def test_linear_fuses_the_argmax_only_where_it_runs_the_amx_kernel():
    torch.manual_seed(3)
    layer = Linear(576, 4096)
    layer.weight.data = torch.randn(4096, 576).bfloat16()
    layer.use_amx_weight(max_rows=32)
    x = torch.randn(20, 576).bfloat16()
    assert torch.equal(layer.greedy_argmax(x), layer.forward_float32(x).max(dim=-1).indices)
    assert layer.greedy_argmax(torch.randn(33, 576).bfloat16()) is None  # past its rows
    assert layer.greedy_argmax(torch.randn(20, 576)) is None  # float32 activations
