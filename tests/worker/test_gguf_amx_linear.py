"""The 4-bit GGUF AMX linear (csrc/gguf_amx_linear.cpp) against the dense bfloat16 weight.

The kernel's promise is exactness, not closeness: the weights it rounds in registers are
gguf's own dequantisation (``gguf.quants.dequantize``, an independent implementation)
rounded to bfloat16, and every output sums the same bfloat16 products in the same order
as the AMX kernel on that dense weight, so the two agree bit for bit; a wrong nibble,
scale, minimum, pair order, strip, token tile or transposed store shows as a different
value. Skipped where the CPU or the OS gives no AMX tiles (the kernel is then never
chosen)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from inflight.kernels import cpu
from inflight.model.linear import Linear
from inflight.model.loader import QuantizedWeight
from tests.helpers.bf16_matmul import assert_within_one_ulp, reference

pytestmark = pytest.mark.skipif(
    not cpu.gguf_amx_linear_available(), reason="the GGUF AMX linear needs AMX tiles"
)

Q4_0, Q4_1 = int(GGMLQuantizationType.Q4_0), int(GGMLQuantizationType.Q4_1)


def random_blocks(n: int, k: int, qtype: int, seed: int) -> torch.Tensor:
    """[n, k / 32 blocks] of random GGUF Q4_0 / Q4_1 blocks: scales of a trained model's
    size (float16 d in [0.002, 0.05), m in [-0.4, 0)) and uniform nibbles."""
    rng = np.random.default_rng(seed)
    blocks = n * k // 32
    d = rng.uniform(0.002, 0.05, blocks).astype(np.float16).view(np.uint8).reshape(blocks, 2)
    nibbles = rng.integers(0, 256, (blocks, 16), dtype=np.uint8)
    if qtype == Q4_1:
        m = rng.uniform(-0.4, 0.0, blocks).astype(np.float16).view(np.uint8).reshape(blocks, 2)
        raw = np.concatenate([d, m, nibbles], axis=1)
    else:
        raw = np.concatenate([d, nibbles], axis=1)
    return torch.from_numpy(raw.reshape(n, -1).copy())


def dense_bf16(blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """gguf's own float32 decoding, rounded to bfloat16 as the loader's dense weight is."""
    weights = quants.dequantize(blocks.numpy(), GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(weights)).reshape(blocks.shape[0], k).bfloat16()


# Rows: a lone row, tails of one and two token tiles (15, 17, 31, 33), 57 (mixed's mean
# batch), an even and an odd count of token tiles (64, 100) and the engine's limit (128).
@pytest.mark.parametrize("qtype", [Q4_1, Q4_0])
@pytest.mark.parametrize("n,k", [(32, 64), (96, 128), (960, 576), (576, 1536)])
@pytest.mark.parametrize("m", [1, 15, 16, 17, 31, 33, 57, 64, 100, 128])
def test_bit_identical_to_the_amx_kernel_on_the_dense_weight(m, n, k, qtype):
    blocks = random_blocks(n, k, qtype, seed=m * 7 + n + k + qtype)
    w = dense_bf16(blocks, qtype, k)
    torch.manual_seed(m + n)
    x = torch.randn(m, k).bfloat16()
    packed = cpu.gguf_amx_pack(blocks, qtype)
    got = cpu.gguf_amx_linear(x, packed, n)
    assert torch.equal(got, cpu.amx_linear(x, cpu.amx_pack(w), n))
    assert_within_one_ulp(got, reference(x, w))
    got32 = cpu.gguf_amx_linear(x, packed, n, float32_out=True)
    assert got32.dtype == torch.float32
    assert torch.equal(got32, cpu.amx_linear(x, cpu.amx_pack(w), n, float32_out=True))


def test_the_shipped_checkpoints_blocks():
    """The default model's own Q4_1 gate/up blocks of layer 0 (real scales and minimums)."""
    from inflight.model.loader import default_model_path, load_checkpoint

    quantized = load_checkpoint(default_model_path()).quantized
    names = ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    blocks = torch.cat([quantized[name].blocks for name in names])
    qtype = quantized[names[0]].ggml_type
    n, k = blocks.shape[0], blocks.shape[1] // 20 * 32
    w = dense_bf16(blocks, qtype, k)
    torch.manual_seed(0)
    x = torch.randn(40, k).bfloat16()
    got = cpu.gguf_amx_linear(x, cpu.gguf_amx_pack(blocks, qtype), n)
    assert torch.equal(got, cpu.amx_linear(x, cpu.amx_pack(w), n))


def test_each_output_feature_reads_its_own_row_and_each_token_its_own_input():
    """Weight row n has one nonzero weight, 1.0 at column n % K (Q4_1: d = 1, m = 0, that
    nibble 1): y[:, n] must be x[:, n % K] exactly; 21 tokens (a partial second token tile)
    must not leak into each other."""
    n, k = 96, 64
    raw = np.zeros((n, k // 32, 20), dtype=np.uint8)
    raw[:, :, 0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    for row in range(n):
        col = row % k
        block, j = divmod(col, 32)
        raw[row, block, 4 + j % 16] = 1 if j < 16 else 0x10
    blocks = torch.from_numpy(raw.reshape(n, -1))
    x = torch.randn(21, k).bfloat16()
    got = cpu.gguf_amx_linear(x, cpu.gguf_amx_pack(blocks, Q4_1), n)
    assert torch.equal(got, x[:, torch.arange(n) % k])


def test_linear_module_reads_the_blocks_within_its_rows_and_the_dense_tiles_past_them():
    blocks = random_blocks(960, 576, Q4_1, seed=3)
    layer = Linear(576, 960)
    layer.weight.data = dense_bf16(blocks, Q4_1, 576)
    layer.use_packed_weight()
    layer.use_amx_weight(max_rows=1024)
    layer.use_gguf_amx(QuantizedWeight(Q4_1, blocks), max_rows=32)
    assert layer.gguf_amx is not None
    for m in (9, 32, 33, 200):
        x = torch.randn(m, 576).bfloat16()
        assert torch.equal(layer(x), cpu.amx_linear(x, layer.amx, 960))
    # types and shapes the kernel does not take leave the layer as it was
    for qtype, n, k in [(8, 960, 576), (Q4_1, 100, 576), (Q4_1, 960, 96)]:
        other = Linear(k, n)
        other.use_gguf_amx(QuantizedWeight(qtype, torch.zeros(n, 1, dtype=torch.uint8)), 32)
        assert other.gguf_amx is None


def test_bad_shapes_and_types_are_refused_with_their_sizes():
    with pytest.raises(RuntimeError, match="multiple of 32 and K of 64"):
        cpu.gguf_amx_pack(random_blocks(48, 64, Q4_1, 0), Q4_1)
    with pytest.raises(RuntimeError, match="multiple of 32 and K of 64"):
        cpu.gguf_amx_pack(random_blocks(32, 96, Q4_1, 0), Q4_1)
    with pytest.raises(RuntimeError, match="Q4_0 or Q4_1"):
        cpu.gguf_amx_pack(torch.zeros(32, 68, dtype=torch.uint8), 8)
    packed = cpu.gguf_amx_pack(random_blocks(32, 128, Q4_1, 0), Q4_1)
    with pytest.raises(RuntimeError, match="needs"):
        cpu.gguf_amx_linear(torch.zeros(2, 64, dtype=torch.bfloat16), packed, 32)
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu.gguf_amx_linear(torch.zeros(2, 128), packed, 32)


def test_chosen_with_amx_unless_turned_off(monkeypatch):
    from inflight.worker import device

    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_bf16"}))
    assert device.gguf_amx_rows() == device.GGUF_AMX_MAX_ROWS
    monkeypatch.setenv("INFLIGHT_GGUF_AMX", "0")
    assert device.gguf_amx_rows() == 0
    monkeypatch.delenv("INFLIGHT_GGUF_AMX")
    monkeypatch.setenv("INFLIGHT_BF16_LINEAR", "onednn")  # no AMX linears at all
    assert device.gguf_amx_rows() == 0
