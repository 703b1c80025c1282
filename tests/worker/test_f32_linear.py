"""The float32 tile linear (csrc/bf16_linear.cpp's ``f32_linear``) against a float64
reference, and the ``Linear`` layer's choice of it.

The kernel sums K float32 products in float32 (one FMA each), so each output must be the
float64 product within float32's accumulated rounding: K * 2^-24 of the sum of the
products' magnitudes. A wrong tile offset, column run or row slice errs by whole values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inflight.kernels import cpu
from inflight.model.linear import Linear

pytestmark = pytest.mark.skipif(
    not cpu.f32_linear_available(), reason="the float32 tile linear needs AVX-512"
)


def assert_float32_sum(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    exact = x.double() @ w.double().T
    bound = (x.double().abs() @ w.double().abs().T) * x.shape[1] * 2.0**-24 + 1e-30
    assert got.dtype == torch.float32 and got.shape == exact.shape
    error = (got.double() - exact).abs()
    assert (error <= bound).all(), f"max error {error.max().item()} at {error.argmax().item()}"


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("n,k", [(16, 1), (48, 63), (80, 96), (960, 576), (576, 1536)])
@pytest.mark.parametrize("m", [1, 5, 6, 7, 13, 57, 200])
def test_matches_float64_reference(m, n, k, two_threads):
    torch.manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k)
    w = torch.randn(n, k)
    assert_float32_sum(cpu.f32_linear(x, cpu.f32_pack_tiles(w), n), x, w)


@pytest.mark.parametrize("n", [80, 208, 576, 960])
@pytest.mark.parametrize("threads", [2, 3])
def test_columns_split_between_threads_give_the_same_bits(n, threads):
    """A thread's run of 16-column blocks may start or end inside a 64-column tile: each
    column must come out bit for bit as one thread computes it."""
    torch.manual_seed(n + threads)
    x = torch.randn(13, 96)
    w = torch.randn(n, 96)
    packed = cpu.f32_pack_tiles(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = cpu.f32_linear(x, packed, n)
        torch.set_num_threads(threads)
        split = cpu.f32_linear(x, packed, n)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(split, alone)
    assert_float32_sum(split, x, w)


def test_each_output_column_reads_its_own_weight_row():
    """Weight row n = e_(n mod K): y[:, n] must be x[:, n % K] exactly."""
    n, k = 80, 32
    w = torch.zeros(n, k)
    w[torch.arange(n), torch.arange(n) % k] = 1
    x = torch.randn(9, k)
    assert torch.equal(cpu.f32_linear(x, cpu.f32_pack_tiles(w), n), x[:, torch.arange(n) % k])


def test_wide_outputs_streamed_past_the_cache_are_the_same_sums(two_threads):
    """Rows of 16384 columns or more (an output layer) are written with non-temporal
    stores: the values must be those of the cached path (column for column the same
    sums, so the same bits as the narrower call on the same weight rows)."""
    torch.manual_seed(4)
    x = torch.randn(7, 64)
    w = torch.randn(16384, 64)
    wide = cpu.f32_linear(x, cpu.f32_pack_tiles(w), 16384)
    narrow = cpu.f32_linear(x, cpu.f32_pack_tiles(w[:4096].contiguous()), 4096)
    assert torch.equal(wide[:, :4096], narrow)
    assert_float32_sum(wide, x, w)


@pytest.mark.parametrize("m", [1, 7, 57, 200])
@pytest.mark.parametrize("n", [64, 4096, 49152])
def test_fused_argmax_is_the_argmax_of_the_logits(m, n, two_threads):
    torch.manual_seed(m + n)
    x = torch.randn(m, 576)
    packed = cpu.f32_pack_tiles(torch.randn(n, 576) * 0.05)
    expected = cpu.f32_linear(x, packed, n).max(dim=-1).indices
    assert torch.equal(cpu.f32_linear_argmax(x, packed, n), expected)


def test_fused_argmax_takes_the_lowest_index_of_a_tie_and_marks_nan_rows(two_threads):
    n, k = 4096, 64
    torch.manual_seed(1)
    w = torch.randn(n, k) * 0.01
    x = torch.randn(24, k)
    for column in (5, 21, 40, 4090):  # the same lane, the next tile, the other thread's run
        w[column] = x[0]
    assert cpu.f32_linear_argmax(x, cpu.f32_pack_tiles(w), n)[0] == 5
    w[5] = 0
    assert cpu.f32_linear_argmax(x, cpu.f32_pack_tiles(w), n)[0] == 21
    x[3, 7] = float("nan")
    got = cpu.f32_linear_argmax(x, cpu.f32_pack_tiles(w), n)
    assert got[3] == -1 and got[0] == 21


def test_linear_takes_the_kernel_past_the_gguf_rows_and_within_its_own():
    torch.manual_seed(0)
    layer = Linear(576, 960)
    layer.weight.data = torch.randn(960, 576)
    layer.use_f32_tiles(max_rows=64)
    assert layer.tiles32 is not None
    for m in (1, 9, 64):
        x = torch.randn(m, 576)
        assert layer._own_choice(x) == "tiles32"
        assert_float32_sum(layer(x), x, layer.weight)
    x = torch.randn(65, 576)  # past its rows: PyTorch's GEMM
    assert layer._own_choice(x) is None
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight))
    assert layer._own_choice(torch.randn(8, 576).bfloat16()) is None
    layer.block_max_rows, layer.blocks = 32, object()  # GGUF blocks take steps up to 32 rows
    assert layer._own_choice(torch.randn(32, 576)) is None
    assert layer._own_choice(torch.randn(33, 576)) == "tiles32"
    assert torch.equal(
        layer.greedy_argmax(torch.ones(33, 576)), layer(torch.ones(33, 576)).max(-1).indices
    )
    odd = Linear(576, 100)  # not a multiple of 16 columns: no tiles
    odd.weight.data = torch.randn(100, 576)
    odd.use_f32_tiles(max_rows=64)
    assert odd.tiles32 is None


def test_bad_shapes_are_refused_with_their_sizes():
    with pytest.raises(RuntimeError, match="multiple of 16"):
        cpu.f32_pack_tiles(torch.zeros(20, 8))
    with pytest.raises(RuntimeError, match="float32"):
        cpu.f32_pack_tiles(torch.zeros(16, 8, dtype=torch.bfloat16))
    packed = cpu.f32_pack_tiles(torch.zeros(32, 8))
    with pytest.raises(RuntimeError, match="needs"):
        cpu.f32_linear(torch.zeros(2, 16), packed, 32)
    with pytest.raises(RuntimeError, match="float32"):
        cpu.f32_linear(torch.zeros(2, 8, dtype=torch.bfloat16), packed, 32)


def test_the_kernel_is_turned_off_by_its_variable(monkeypatch):
    from inflight.worker import device

    assert device.f32_tile_matmul_rows() == device.F32_TILE_MATMUL_MAX_ROWS
    monkeypatch.setenv("INFLIGHT_F32_LINEAR", "torch")
    assert device.f32_tile_matmul_rows() == 0


def test_small_float32_steps_read_the_blocks_only_up_to_where_the_tiles_win(monkeypatch):
    """With the tile kernel, float32 steps of 17-32 rows take it instead of the GGUF
    blocks; without it (INFLIGHT_F32_LINEAR=torch) the blocks keep steps up to 32."""
    from inflight.model.loader import default_model_path, load_checkpoint
    from inflight.worker import device

    quantized = load_checkpoint(default_model_path()).quantized
    cpu_device = torch.device("cpu")
    assert device.block_matmul_rows(None, quantized, cpu_device, torch.float32) == 16
    assert device.block_matmul_rows(None, quantized, cpu_device, torch.bfloat16) == 8
    monkeypatch.setenv("INFLIGHT_F32_LINEAR", "torch")
    assert device.block_matmul_rows(None, quantized, cpu_device, torch.float32) == 32
