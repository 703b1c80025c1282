"""The fused C++ layer ops against the PyTorch modules they replace (model/llama.py).

float32 results must agree to float32 rounding; bfloat16 results may differ by one
bfloat16 step where a float32 sum rounded the other way, but almost all must be equal.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inflight.attention.torch_paged import write_kv
from inflight.kernels import cpu
from inflight.model.arch import LlamaArchConfig
from inflight.model.llama import RMSNorm, RotaryEmbedding

pytestmark = pytest.mark.skipif(not cpu.available(), reason="needs the C++ CPU kernels")
DTYPES = [torch.float32, torch.bfloat16]


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=1.6e-2, atol=1e-5)
        assert (actual == expected).float().mean() > 0.98


@pytest.mark.parametrize("weight_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 130])
def test_rms_norm(weight_dtype, out_dtype, tokens):
    norm = RMSNorm(96, eps=1e-5)
    norm.weight.data = (torch.randn(96) * 0.5 + 1).to(weight_dtype)
    x = torch.randn(tokens, 96) * 3
    expected = norm(x, out_dtype)
    assert_close(cpu.rms_norm(x, norm.weight, norm.eps, out_dtype), expected)


@pytest.mark.parametrize("add_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_rms_norm_adds_into_the_residual_first(add_dtype, out_dtype):
    norm = RMSNorm(96, eps=1e-5)
    norm.weight.data = torch.randn(96) * 0.5 + 1
    x = torch.randn(9, 96) * 3
    add = torch.randn(9, 96).to(add_dtype)
    residual_ref, residual = x.clone(), x.clone()
    expected = norm(residual_ref, out_dtype, add=add)  # the PyTorch path: x.add_(add)
    assert torch.equal(residual_ref, x + add)
    actual = cpu.rms_norm(residual, norm.weight, norm.eps, out_dtype, add)
    assert torch.equal(residual, residual_ref)  # the same float32 sum, in place
    assert_close(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_silu_mul(dtype, tokens):
    gate_up = (torch.randn(tokens, 2 * 200) * 4).to(dtype)  # 200: a tail after 16-lane blocks
    gate, up = gate_up.split(200, dim=-1)
    assert_close(cpu.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("act_dtype", DTYPES)
@pytest.mark.parametrize("kv_dtype", [*DTYPES, torch.int8])
def test_rope_write_kv_matches_rotary_and_write_kv(act_dtype, kv_dtype):
    heads, kv_heads, head_dim, block_size, num_blocks = 6, 2, 16, 4, 10
    arch = LlamaArchConfig(
        vocab_size=10, hidden_size=heads * head_dim, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    rotary = RotaryEmbedding(arch, max_positions=64)
    tokens = 9
    positions = torch.tensor([0, 1, 2, 3, 4, 17, 40, 41, 63])
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(act_dtype)

    def empty_caches():
        scales = (None, None)
        if kv_dtype == torch.int8:  # int8 also writes a scale per token and head
            scales = (torch.zeros(num_blocks, kv_heads, block_size),
                      torch.zeros(num_blocks, kv_heads, block_size))
        return (torch.zeros(num_blocks, kv_heads, head_dim, block_size, dtype=kv_dtype),
                torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=kv_dtype), *scales)

    # Reference: the PyTorch path of Attention.forward.
    q_ref, k_ref, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q_ref, k_ref = rotary(positions, q_ref.view(tokens, heads, head_dim),
                          k_ref.view(tokens, kv_heads, head_dim))
    v = v.view(tokens, kv_heads, head_dim)
    k_cache_ref, v_cache_ref, k_scale_ref, v_scale_ref = empty_caches()

    class Slots:  # the three fields write_kv reads from AttentionMetadata
        slot_mapping, slot_block, slot_offset = slots, slots // block_size, slots % block_size

    write_kv(k_cache_ref, v_cache_ref, k_ref, v, Slots,  # type: ignore[arg-type]
             k_scale_ref, v_scale_ref)

    k_cache, v_cache, k_scale, v_scale = empty_caches()
    q, k = cpu.rope_write_kv(qkv, positions, rotary.cos, rotary.sin, k_cache, v_cache, slots,
                             heads, kv_heads, k_scale, v_scale)
    assert_close(q, q_ref)
    assert_close(k, k_ref)
    if kv_dtype == torch.int8:
        # the same arithmetic as torch_paged.quantize_kv, so the same bytes and scales
        assert torch.equal(k_cache, k_cache_ref)
        assert torch.equal(k_scale, k_scale_ref) and torch.equal(v_scale, v_scale_ref)
        assert bool((k_scale_ref > 0).any())
    else:
        assert_close(k_cache, k_cache_ref)
    assert torch.equal(v_cache, v_cache_ref)  # values are copied, never recomputed


def test_rope_write_kv_rejects_out_of_range_slots():
    k_cache, v_cache = torch.zeros(2, 1, 4, 4), torch.zeros(2, 4, 1, 4)
    cos = sin = torch.zeros(8, 4)
    with pytest.raises(RuntimeError, match="slot 8 out of range"):
        cpu.rope_write_kv(torch.zeros(1, 12), torch.tensor([0]), cos, sin, k_cache, v_cache,
                          torch.tensor([8]), 1, 1)
