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
