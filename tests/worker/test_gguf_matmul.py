"""The GGUF block matmul kernel against the gguf package's own dequantisation.

The kernel's claim is that it computes with exactly the float32 weights the loader decodes;
an identity matrix as input reads those weights back bit for bit. Products with random
inputs are checked against a float64 reference.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from inflight.kernels import cpu

pytestmark = pytest.mark.skipif(
    not cpu.gguf_matmul_available(), reason="the GGUF block kernel needs AVX-512 and a compiler"
)
TYPES = [QT.Q4_0, QT.Q4_1, QT.Q8_0]


def random_blocks(qtype: QT, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random but well-formed blocks: finite float16 scales (and minimums), random quants."""
    rng = np.random.default_rng(seed)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // block_size
    raw = rng.integers(0, 256, size=(n, type_size), dtype=np.uint8)
    header = 4 if qtype == QT.Q4_1 else 2
    halves = rng.uniform(-0.05, 0.05, size=(n, header // 2)).astype(np.float16)
    raw[:, :header] = halves.view(np.uint8).reshape(n, header)
    return raw.reshape(rows, cols // block_size * type_size)


def packed(blocks: np.ndarray, qtype: QT) -> torch.Tensor:
    return cpu.gguf_pack(torch.from_numpy(blocks), int(qtype))


def reference_weights(qtype: QT, blocks: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32))


@pytest.mark.parametrize("qtype", TYPES)
def test_identity_input_reads_back_the_exact_weights(qtype: QT) -> None:
    blocks = random_blocks(qtype, rows=40, cols=96)
    weights = reference_weights(qtype, blocks)
    out = cpu.gguf_matmul(torch.eye(96), packed(blocks, qtype), int(qtype))
    assert torch.equal(out, weights.T)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13, 33])
def test_products_match_float64(qtype: QT, rows: int) -> None:
    # 7 output features: exercises both the 4-row groups and the leftover rows.
    blocks = random_blocks(qtype, rows=4 * 16 + 7, cols=192, seed=rows)
    weights = reference_weights(qtype, blocks).double()
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows))
    out = cpu.gguf_matmul(x, packed(blocks, qtype), int(qtype))
    expected = x.double() @ weights.T
    scale = (x.double().abs() @ weights.abs().T).max()
    assert out.dtype == torch.float32 and out.shape == expected.shape
    assert (out.double() - expected).abs().max() <= 1e-6 * scale


def test_rejects_malformed_inputs() -> None:
    blocks = packed(random_blocks(QT.Q4_1, rows=4, cols=64), QT.Q4_1)
    with pytest.raises(RuntimeError, match="bytes per row"):
        cpu.gguf_matmul(torch.randn(1, 96), blocks, int(QT.Q4_1))
    with pytest.raises(RuntimeError, match="unsupported ggml type"):
        cpu.gguf_matmul(torch.randn(1, 64), blocks, int(QT.Q5_0))
    with pytest.raises(RuntimeError, match="float32"):
        cpu.gguf_matmul(torch.randn(1, 64, dtype=torch.float64), blocks, int(QT.Q4_1))


# The bfloat16-dot kernel (csrc/gguf_bf16_dot.cpp): 4-bit blocks only, exact weights, the
# activations rounded to bfloat16 for q . x (sum(x) stays float32).
bf16_dot = pytest.mark.skipif(
    not cpu.gguf_bf16_dot_available(), reason="the bfloat16-dot kernel needs AVX512-BF16"
)
FOUR_BIT = [QT.Q4_0, QT.Q4_1]


def packed_bf16_dot(blocks: np.ndarray, qtype: QT) -> torch.Tensor:
    return cpu.gguf_pack_bf16_dot(torch.from_numpy(blocks), int(qtype))


@bf16_dot
@pytest.mark.parametrize("qtype", FOUR_BIT)
@pytest.mark.parametrize("cols", [64, 96, 576])  # even, odd (padded) and SmolLM2's blocks
def test_bf16_dot_identity_input_reads_back_the_exact_weights(qtype: QT, cols: int) -> None:
    # Rows of the identity are exact in bfloat16, so the weights come back bit for bit:
    # the packing's lane order, the pair scales and the padding block all show here.
    blocks = random_blocks(qtype, rows=4 * 5 + 3, cols=cols, seed=cols)
    weights = reference_weights(qtype, blocks)
    out = cpu.gguf_matmul(
        torch.eye(cols), packed_bf16_dot(blocks, qtype), int(qtype) | cpu.GGUF_BF16_DOT
    )
    assert torch.equal(out, weights.T)


@bf16_dot
@pytest.mark.parametrize("qtype", FOUR_BIT)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13])
def test_bf16_dot_products_match_bfloat16_inputs(qtype: QT, rows: int) -> None:
    """Against float64 on the same inputs as the kernel sees: x rounded to bfloat16 for the
    nibbles' dot product, float32 x for the offsets' (w = q d + m)."""
    cols = 160  # 5 blocks: two pairs and a padded one
    blocks = random_blocks(qtype, rows=4 * 8 + 3, cols=cols, seed=rows)
    weights = reference_weights(qtype, blocks).double()
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)) * 3
    out = cpu.gguf_matmul(x, packed_bf16_dot(blocks, qtype), int(qtype) | cpu.GGUF_BF16_DOT)
    q, d, m = _decode(blocks, qtype, cols // 32)
    assert torch.equal((q * d + m).float(), weights.float())  # the decoding is gguf's
    xb = x.bfloat16().double()
    expected = xb @ (q * d).T + x.double() @ m.T
    scale = (x.double().abs() @ weights.abs().T).max()
    assert out.shape == expected.shape
    assert (out.double() - expected).abs().max() <= 1e-6 * scale
    # and the rounding is really there: float32 inputs would land further away
    exact = x.double() @ weights.T
    assert (out.double() - exact).abs().max() > 1e-4 * scale


def _decode(
    blocks: np.ndarray, qtype: QT, n_blocks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 ``[rows, cols]`` nibbles q, and each weight's block scale d and offset m."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = blocks.reshape(blocks.shape[0], n_blocks, size)
    d = raw[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    if qtype == QT.Q4_1:
        m = raw[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    else:
        m = -8.0 * d
    nibbles = raw[:, :, size - 16:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=2).astype(np.float64)
    rows = blocks.shape[0]
    return (
        torch.from_numpy(q.reshape(rows, -1)),
        torch.from_numpy(np.repeat(d, 32, axis=1)),
        torch.from_numpy(np.repeat(m, 32, axis=1)),
    )


@bf16_dot
def test_bf16_dot_rejects_malformed_inputs() -> None:
    blocks = random_blocks(QT.Q4_1, rows=4, cols=64)
    with pytest.raises(RuntimeError, match="Q4_0 .* or Q4_1"):
        cpu.gguf_pack_bf16_dot(torch.from_numpy(random_blocks(QT.Q8_0, 4, 64)), int(QT.Q8_0))
    flagged = int(QT.Q4_1) | cpu.GGUF_BF16_DOT
    with pytest.raises(RuntimeError, match="bytes per row"):
        cpu.gguf_matmul(torch.randn(1, 128), packed_bf16_dot(blocks, QT.Q4_1), flagged)
    with pytest.raises(RuntimeError, match="Q4_0 or Q4_1"):
        cpu.gguf_matmul(torch.randn(1, 64), packed_bf16_dot(blocks, QT.Q4_1),
                        int(QT.Q8_0) | cpu.GGUF_BF16_DOT)
