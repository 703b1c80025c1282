"""All decoder layers of a decode step as one C++ call (``csrc/decode_layer.cpp``).

A single-stream decode step spends as long in Python and the dispatcher between a layer's
nine kernels as in the kernels themselves. Where every linear layer reads GGUF blocks,
a ``DecodeStack`` runs the same kernels in the same order from C++ for every layer, so the
outputs are bit-identical to the layer-by-layer path (tests/e2e/test_fused_decode.py). It
holds the layers' weights and KV caches, so a step passes only its own tensors.

``FusedDecodeTiles`` does the same for the bfloat16 decode steps past the block kernel's
rows whose linears read 4-bit blocks with AMX tiles (``Linear.use_gguf_amx``), or, on CPUs
with AVX512-BF16 and no AMX, bfloat16 pair tiles (``Linear.use_pair_weight``): on the
Intel Xeon with AMX a ``mixed`` decode step of 9-128 sequences made ~780 Python-level op
calls, 3-5 ms of a 35-130 ms step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from inflight.attention.metadata import AttentionMetadata, VarlenGroup
from inflight.kernels import cpu as cpu_kernels
from inflight.worker.kv_cache import LayerKVCache

if TYPE_CHECKING:
    from inflight.model.linear import Linear
    from inflight.model.llama import Attention, DecoderLayer, LlamaForCausalLM


@dataclass(slots=True)
class FusedDecode:
    """The layers' fixed arguments (6 tensors and 4 ggml types a layer, see
    ``cpu_kernels.decode_stack``) and the C++ stack built from them and the KV caches."""

    layer_tensors: list[torch.Tensor]
    layer_types: list[int]
    eps: float
    max_rows: int  # steps of more tokens take the matmul paths, not the block kernel
    stacks: _StackCache = field(default_factory=lambda: _StackCache())

    @staticmethod
    def build(model: LlamaForCausalLM) -> FusedDecode | None:
        """The model's fused decode, or None unless every linear layer reads GGUF blocks
        without a bias and the fused C++ layer ops are on. Build once the weights are
        final (this keeps references to them)."""
        layers = _fusable_layers(model, lambda linear: linear.blocks is not None)
        if layers is None or model.block_max_rows <= 0:
            return None
        tensors: list[torch.Tensor] = []
        types: list[int] = []
        for layer, linears in layers:
            tensors += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            for linear in linears:
                assert linear.blocks is not None
                tensors.append(linear.blocks.blocks)
                types.append(linear.blocks.ggml_type)
        eps = layers[0][0].input_layernorm.eps
        return FusedDecode(tensors, types, eps, model.block_max_rows)

    def applies(self, num_tokens: int, metadata: AttentionMetadata) -> bool:
        """Few enough tokens for the block kernel, and every one a varlen decode."""
        return num_tokens <= self.max_rows and _decode_only(metadata)

    def run(
        self, model: LlamaForCausalLM, x: torch.Tensor, positions: torch.Tensor,
        kv_caches: list[LayerKVCache], metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """All layers over the residual stream ``x [T, hidden]`` (float32, updated in
        place); returns the last layer's output, still to be added by the final norm."""

        def make(attn: Attention, k: list[torch.Tensor], v: list[torch.Tensor],
                 k_scales: list[torch.Tensor], v_scales: list[torch.Tensor]) -> torch.ScriptObject:
            return cpu_kernels.decode_stack(
                self.layer_tensors, self.layer_types, self.eps, k, v, k_scales, v_scales,
                attn.num_heads, attn.num_kv_heads, attn.scale,
            )

        return self.stacks.run(model, kv_caches, make, x, positions, metadata)


def _fusable_layers(
    model: LlamaForCausalLM, holds: Callable[[Linear], bool]
) -> list[tuple[DecoderLayer, tuple[Linear, Linear, Linear, Linear]]] | None:
    """Each decoder layer with its qkv, o, gate_up and down projections, or None unless
    every projection ``holds`` its weight form without a bias and the fused C++ layer ops
    are on."""
    layers = [
        (layer, (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                 layer.mlp.gate_up_proj, layer.mlp.down_proj))
        for layer in model.layers
    ]
    usable = bool(layers) and all(
        layer.self_attn.fused and layer.mlp.fused and layer.input_layernorm.fused
        and all(holds(linear) and linear.bias is None for linear in linears)
        for layer, linears in layers
    )
    return layers if usable else None


def _decode_only(metadata: AttentionMetadata) -> bool:
    """Every token of the step a decode token of one varlen group."""
    decode = metadata.decode
    return (
        metadata.prefill is None and metadata.prompts is None
        and isinstance(decode, VarlenGroup) and decode.token_index is None
    )


class _StackCache:
    """A C++ decode stack and the layers' caches it was built for (held here, so compared
    by identity): built again only when the engine's caches change."""

    __slots__ = ("stack", "caches")

    def __init__(self) -> None:
        self.stack: torch.ScriptObject | None = None
        self.caches: tuple[LayerKVCache, ...] = ()

    def run(
        self, model: LlamaForCausalLM, kv_caches: list[LayerKVCache],
        make: Callable[..., torch.ScriptObject], x: torch.Tensor, positions: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """``make(attention module, k caches, v caches, k scales, v scales)`` builds the
        stack; its ``run`` takes the step's tensors."""
        same = len(kv_caches) == len(self.caches) and all(
            held is given for held, given in zip(self.caches, kv_caches, strict=True)
        )
        if self.stack is None or not same:
            scales = [c for c in kv_caches if c.k_scale is not None]
            self.stack = make(
                model.layers[0].self_attn, [c.k for c in kv_caches], [c.v for c in kv_caches],
                [c.k_scale for c in scales], [c.v_scale for c in scales],
            )
            self.caches = tuple(kv_caches)
        decode = metadata.decode
        assert isinstance(decode, VarlenGroup)
        return self.stack.run(
            x, positions, model.rotary.cos, model.rotary.sin, metadata.slot_mapping,
            decode.block_tables, decode.query_start, decode.seq_lens,
        )


@dataclass(slots=True)
class FusedDecodeTiles:
    """The bfloat16 decode steps of ``block_max_rows < T <= max_rows`` tokens whose decoder
    linears all read 4-bit blocks with AMX tiles, or all bfloat16 pair tiles
    (``pair_tiles``), as one C++ call (``DecodeStackTiles``): the layers' norms and packed
    weights (6 tensors a layer), the projections' output sizes (4 a layer) and the stack
    built from them and the KV caches."""

    layer_tensors: list[torch.Tensor]
    out_features: list[int]
    eps: float
    max_rows: int
    pair_tiles: bool = False
    stacks: _StackCache = field(default_factory=lambda: _StackCache())

    @staticmethod
    def build(model: LlamaForCausalLM) -> FusedDecodeTiles | None:
        """None unless every decoder linear holds pair tiles (or none does and every one
        ``gguf_amx`` blocks: Linear's own order of choice) without a bias, the model
        computes in bfloat16 and the fused C++ layer ops are on."""
        if model.embed_tokens.weight.dtype != torch.bfloat16:
            return None
        pair_tiles = True
        layers = _fusable_layers(model, lambda linear: linear.pairs is not None)
        if layers is None:
            layers = _fusable_layers(
                model, lambda linear: linear.gguf_amx is not None and linear.pairs is None
            )
            pair_tiles = False
        if layers is None:
            return None
        tensors: list[torch.Tensor] = []
        features: list[int] = []
        max_rows = []
        for layer, linears in layers:
            tensors += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            for linear in linears:
                weight = linear.pairs if pair_tiles else linear.gguf_amx
                assert weight is not None
                tensors.append(weight)
                features.append(linear.weight.shape[0])
                max_rows.append(linear.pair_max_rows if pair_tiles else linear.gguf_amx_max_rows)
        return FusedDecodeTiles(
            tensors, features, layers[0][0].input_layernorm.eps, min(max_rows), pair_tiles
        )

    def applies(self, num_tokens: int, metadata: AttentionMetadata, block_max_rows: int) -> bool:
        """More tokens than the block kernel takes (``block_max_rows``, 0 while the model
        is held to its dense weights), at most ``max_rows``, every one a varlen decode."""
        return 0 < block_max_rows < num_tokens <= self.max_rows and _decode_only(metadata)

    def run(
        self, model: LlamaForCausalLM, x: torch.Tensor, positions: torch.Tensor,
        kv_caches: list[LayerKVCache], metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """As :meth:`FusedDecode.run`."""

        def make(attn: Attention, k: list[torch.Tensor], v: list[torch.Tensor],
                 k_scales: list[torch.Tensor], v_scales: list[torch.Tensor]) -> torch.ScriptObject:
            return cpu_kernels.decode_stack_tiles(
                self.layer_tensors, self.out_features, self.eps, k, v, k_scales, v_scales,
                attn.num_heads, attn.num_kv_heads, attn.scale, self.pair_tiles,
            )

        return self.stacks.run(model, kv_caches, make, x, positions, metadata)
