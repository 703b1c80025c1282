"""The default model's GGUF blocks, as the model uses them, hold the same weights as its
dense parameters: fused q/k/v and gate/up blocks in the right order, rows un-permuted like
the dense q/k, the tied lm_head reading the embedding's blocks."""

from __future__ import annotations

import pytest
import torch

from inflight.kernels import cpu
from inflight.model.linear import Linear
from inflight.model.loader import default_model_path, load_checkpoint
from inflight.worker.device import block_matmul_rows, build_model, gguf_bf16_dot

pytestmark = pytest.mark.skipif(
    not cpu.gguf_matmul_available(), reason="the GGUF block kernel needs AVX-512 and a compiler"
)


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint(default_model_path())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_linear_layer_reads_blocks_equal_to_its_dense_weight(checkpoint, dtype):
    rows = block_matmul_rows(None, checkpoint.quantized, torch.device("cpu"), dtype)
    assert rows > 0
    model = build_model(
        checkpoint.arch, checkpoint.weights, torch.device("cpu"), dtype, 64,
        quantized=checkpoint.quantized, block_max_rows=rows,
    )
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert layers and all(layer.blocks is not None for layer in layers)
    assert model.lm_head.blocks is not None  # tied: the embedding's Q8_0 blocks
    # bfloat16 models on CPUs with AVX512-BF16 compute the 4-bit blocks with bfloat16 dot
    # products (inputs rounded to bfloat16: relative error 2^-9 each); the Q8_0 output
    # layer and float32 models keep float32 inputs.
    bf16_dot = gguf_bf16_dot(dtype, torch.device("cpu"))
    assert model.lm_head.blocks.ggml_type == 8
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for layer in layers[:9] + [model.lm_head]:
            assert layer.blocks is not None
            rounded = bool(layer.blocks.ggml_type & cpu.GGUF_BF16_DOT)
            assert rounded == (bf16_dot and layer is not model.lm_head)
            x = torch.randn(3, layer.weight.shape[1], generator=generator)
            from_blocks = layer(x)  # 3 rows: the block kernel
            dense = x.double() @ checkpoint_dense(checkpoint, layer, model).T
            scale = (x.double().abs() @ checkpoint_dense(checkpoint, layer, model).abs().T).max()
            tolerance = 2 ** -9 if rounded else 1e-5
            assert (from_blocks.double() - dense).abs().max() <= tolerance * scale


def checkpoint_dense(checkpoint, layer: Linear, model) -> torch.Tensor:
    """The layer's weight rebuilt from the checkpoint's float32 tensors (HF order)."""
    w = checkpoint.weights
    if layer is model.lm_head:
        return w["model.embed_tokens.weight"].double()
    for i, block in enumerate(model.layers):
        p = f"model.layers.{i}."
        parts = {
            id(block.self_attn.qkv_proj): [p + f"self_attn.{x}_proj.weight" for x in "qkv"],
            id(block.self_attn.o_proj): [p + "self_attn.o_proj.weight"],
            id(block.mlp.gate_up_proj): [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
            id(block.mlp.down_proj): [p + "mlp.down_proj.weight"],
        }.get(id(layer))
        if parts:
            return torch.cat([w[name] for name in parts]).double()
    raise AssertionError("unknown layer")


def test_quantization_none_keeps_dense_weights(checkpoint):
    assert block_matmul_rows("none", checkpoint.quantized, torch.device("cpu"), torch.float32) == 0


def test_fused_projections_are_views_of_the_decoded_weights(checkpoint):
    """The GGUF loader decodes each layer's q/k/v and gate/up next to each other, so the
    fused weights are the decoded tensors themselves, not copies, and equal their concat."""
    model = build_model(checkpoint.arch, checkpoint.weights, torch.device("cpu"),
                        torch.float32, 256)
    for i, layer in enumerate(model.layers):
        src = f"model.layers.{i}."
        for fused, parts in (
            (layer.self_attn.qkv_proj.weight,
             [src + f"self_attn.{p}_proj.weight" for p in "qkv"]),
            (layer.mlp.gate_up_proj.weight, [src + "mlp.gate_proj.weight", src + "mlp.up_proj.weight"]),
        ):
            first = checkpoint.weights[parts[0]]
            assert fused.data_ptr() == first.data_ptr(), "fused by a copy"
            assert torch.equal(fused, torch.cat([checkpoint.weights[p] for p in parts]))



def test_bf16_dot_blocks_only_where_bf16_dots_pay(monkeypatch):
    """The 4-bit blocks of a bfloat16 model use bfloat16 dot products only where they
    outrun float32 FMAs (``cpu.bf16_dots_pay``; INFLIGHT_BF16_DOTS overrides it)."""
    if not cpu.gguf_bf16_dot_available():
        pytest.skip("the bfloat16-dot GGUF kernel needs AVX512-BF16")
    try:
        for dots, expected in (("bf16", True), ("fp32", False)):
            monkeypatch.setenv("INFLIGHT_BF16_DOTS", dots)
            cpu.bf16_dots_pay.cache_clear()
            assert gguf_bf16_dot(torch.bfloat16, torch.device("cpu")) is expected
            assert gguf_bf16_dot(torch.float32, torch.device("cpu")) is False
    finally:
        cpu.bf16_dots_pay.cache_clear()


def test_bf16_rounding_for_float32_compute_is_in_place_and_exact():
    """``build_model(round_to=torch.bfloat16)`` for a float32 model (bf16 weights computed
    in float32) rounds the caller's tensors in place, LLMEngine handing them over: every
    parameter must equal ``w.to(bfloat16).float()`` of the loaded weight, bit for bit, the
    fused q/k/v and gate/up included."""
    fresh = load_checkpoint(default_model_path())  # its own: the tensors change
    original = {name: w.clone() for name, w in fresh.weights.items()}
    model = build_model(
        fresh.arch, fresh.weights, torch.device("cpu"), torch.float32, 64,
        round_to=torch.bfloat16,
    )

    def rounded(name: str) -> torch.Tensor:
        return original[name].to(torch.bfloat16).float()

    for name in original:
        assert torch.equal(fresh.weights[name], rounded(name)), name
    layer = model.layers[3]
    p = "model.layers.3."
    qkv = torch.cat([rounded(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
    gate_up = torch.cat([rounded(p + f"mlp.{x}_proj.weight") for x in ("gate", "up")])
    assert torch.equal(layer.self_attn.qkv_proj.weight, qkv)
    assert torch.equal(layer.mlp.gate_up_proj.weight, gate_up)
    assert torch.equal(layer.mlp.down_proj.weight, rounded(p + "mlp.down_proj.weight"))
    assert torch.equal(model.embed_tokens.weight, rounded("model.embed_tokens.weight"))
    down = p + "mlp.down_proj.weight"
    assert not torch.equal(rounded(down), original[down])  # the rounding did something
