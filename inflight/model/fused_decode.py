"""Each decoder layer of a small decode step as one C++ call (``csrc/decode_layer.cpp``).

A single-stream decode step spends as long in Python and the dispatcher between a layer's
nine kernels as in the kernels themselves. Where every linear layer reads GGUF blocks,
``decode_layer`` runs the same kernels in the same order from C++, so the outputs are
bit-identical to the layer-by-layer path (tests/e2e/test_fused_decode.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from inflight.attention.metadata import AttentionMetadata, VarlenGroup
from inflight.kernels import cpu as cpu_kernels
from inflight.worker.kv_cache import LayerKVCache

if TYPE_CHECKING:
    from inflight.model.llama import LlamaForCausalLM


@dataclass(frozen=True, slots=True)
class FusedDecode:
    """The fixed arguments of each layer's call: its two RMSNorm weights, the norm's eps,
    then (blocks, GGML type) of qkv, o, gate_up and down."""

    layer_args: list[tuple[object, ...]]
    max_rows: int  # steps of more tokens take the matmul paths, not the block kernel

    @staticmethod
    def build(model: LlamaForCausalLM) -> FusedDecode | None:
        """The model's fused decode, or None unless every linear layer reads GGUF blocks
        without a bias and the fused C++ layer ops are on. Build once the weights are
        final (this keeps references to them)."""
        layers = list(model.layers)
        projections = [
            (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
             layer.mlp.gate_up_proj, layer.mlp.down_proj)
            for layer in layers
        ]
        usable = (
            model.block_max_rows > 0 and bool(layers)
            and all(linear.blocks is not None and linear.bias is None
                    for linears in projections for linear in linears)
            and all(layer.self_attn.fused and layer.mlp.fused and layer.input_layernorm.fused
                    for layer in layers)
        )
        if not usable:
            return None
        layer_args = []
        for layer, linears in zip(layers, projections, strict=True):
            weights: list[object] = []
            for linear in linears:
                assert linear.blocks is not None
                weights += [linear.blocks.blocks, linear.blocks.ggml_type]
            layer_args.append((
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                layer.input_layernorm.eps, *weights,
            ))
        return FusedDecode(layer_args, model.block_max_rows)

    def applies(self, num_tokens: int, metadata: AttentionMetadata) -> bool:
        """Few enough tokens for the block kernel, and every one a varlen decode."""
        decode = metadata.decode
        return (
            num_tokens <= self.max_rows and metadata.prefill is None
            and metadata.prompts is None and isinstance(decode, VarlenGroup)
            and decode.token_index is None
        )

    def run(
        self, model: LlamaForCausalLM, x: torch.Tensor, positions: torch.Tensor,
        kv_caches: list[LayerKVCache], metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """All layers over the residual stream ``x [T, hidden]`` (float32, updated in
        place); returns the last layer's output, still to be added by the final norm."""
        decode = metadata.decode
        assert isinstance(decode, VarlenGroup)
        attn = model.layers[0].self_attn
        step = (decode.block_tables, decode.query_start, decode.seq_lens,
                attn.num_heads, attn.num_kv_heads, attn.scale)
        cos, sin, slots = model.rotary.cos, model.rotary.sin, metadata.slot_mapping
        pending = None
        for fixed, (k_cache, v_cache, k_scale, v_scale) in zip(
            self.layer_args, kv_caches, strict=True
        ):
            pending = cpu_kernels.decode_layer(
                x, pending, fixed, positions, cos, sin, k_cache, v_cache, k_scale, v_scale,
                slots, step,
            )
        assert pending is not None
        return pending
