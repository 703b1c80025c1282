"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral without sliding window, Qwen2).

Runs one step over a flat batch of tokens from many sequences; attention reads and writes
K/V through the paged cache. Q/K/V and gate/up projections are fused into single matmuls.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from inflight.attention.metadata import AttentionMetadata
from inflight.attention.torch_paged import paged_attention, write_kv
from inflight.kernels import cpu as cpu_kernels
from inflight.model.arch import LlamaArchConfig
from inflight.model.fused_decode import FusedDecode, FusedDecodeTiles
from inflight.model.linear import Linear
from inflight.model.loader import QuantizedWeight
from inflight.worker.kv_cache import LayerKVCache


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps
        self.fused = False  # one C++ call instead of eight ops (see use_cpu_kernels)

    def forward(
        self, x: torch.Tensor, dtype: torch.dtype | None = None, add: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Normalise ``x``; with ``add``, first ``x += add`` in place (the residual stream
        taking a sublayer's output, fused into the same pass on the CPU)."""
        if self.fused:
            return cpu_kernels.rms_norm(x, self.weight, self.eps, dtype or self.weight.dtype, add)
        if add is not None:
            x.add_(add)
        # Normalise in float32 as transformers does, then cast to the matmuls' input dtype
        # (the residual stream may be float32 while the matmuls run in bfloat16).
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype or self.weight.dtype)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (transformers' convention), cos/sin tables precomputed."""

    def __init__(self, arch: LlamaArchConfig, max_positions: int) -> None:
        super().__init__()
        self.arch = arch
        self.max_positions = max_positions
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build(torch.device("cpu"))

    def build(self, device: torch.device) -> None:
        """(Re)compute the cos/sin tables in float32 on ``device``."""
        arch = self.arch
        with torch.device(device):
            inv_freq = 1.0 / (
                arch.rope_theta
                ** (torch.arange(0, arch.head_dim, 2, dtype=torch.float32) / arch.head_dim)
            )
            if arch.rope_llama3_scaling is not None:
                inv_freq = _llama3_scaled(inv_freq, *arch.rope_llama3_scaling)
            positions = torch.arange(self.max_positions, dtype=torch.float32)
            freqs = torch.outer(positions, inv_freq)
            emb = torch.cat([freqs, freqs], dim=-1)
            self.cos = emb.cos()
            self.sin = emb.sin()

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, KVH, D]."""
        # Rotate in float32 (the tables' dtype) and round once at the end.
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        q32, k32 = q.float(), k.float()
        return (
            (q32 * cos + _rotate_half(q32) * sin).to(q.dtype),
            (k32 * cos + _rotate_half(k32) * sin).to(k.dtype),
        )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _llama3_scaled(
    inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
    original_max_positions: int,
) -> torch.Tensor:
    """Llama 3.1's frequency-dependent RoPE scaling."""
    low_freq_wavelen = original_max_positions / low_freq_factor
    high_freq_wavelen = original_max_positions / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_positions / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class Attention(nn.Module):
    def __init__(self, arch: LlamaArchConfig) -> None:
        super().__init__()
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(
            arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.attention_bias
        )
        self.o_proj = Linear(self.q_size, arch.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5
        self.fused = False  # RoPE and the K/V write in one C++ call

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
        kv_cache: LayerKVCache, metadata: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        k_cache, v_cache, k_scale, v_scale = kv_cache
        if self.fused:
            q, k = cpu_kernels.rope_write_kv(
                qkv, positions, rotary.cos, rotary.sin, k_cache, v_cache,
                metadata.slot_mapping, self.num_heads, self.num_kv_heads, k_scale, v_scale,
            )
        else:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(-1, self.num_heads, self.head_dim)
            k = k.view(-1, self.num_kv_heads, self.head_dim)
            q, k = rotary(positions, q, k)
            write_kv(k_cache, v_cache, k, v, metadata, k_scale, v_scale)
        out = paged_attention(
            q, k, v, k_cache, v_cache, metadata, self.scale, k_scale, v_scale
        )
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, arch: LlamaArchConfig) -> None:
        super().__init__()
        self.intermediate_size = arch.intermediate_size
        self.gate_up_proj = Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = Linear(arch.intermediate_size, arch.hidden_size, bias=False)
        self.fused = False  # silu(gate) * up in one C++ call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused:
            return self.down_proj(cpu_kernels.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, arch: LlamaArchConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch)

    def forward(
        self, x: torch.Tensor, pending: torch.Tensor | None, positions: torch.Tensor,
        rotary: RotaryEmbedding, kv_cache: LayerKVCache, metadata: AttentionMetadata,
        act_dtype: torch.dtype,
    ) -> torch.Tensor:
        """``x`` is the residual stream (float32), updated in place; ``pending`` is the
        previous layer's MLP output, still to be added to it. Returns this layer's MLP
        output, which the next layer's (or the final) norm adds."""
        h = self.input_layernorm(x, act_dtype, add=pending)
        attn = self.self_attn(h, positions, rotary, kv_cache, metadata)
        return self.mlp(self.post_attention_layernorm(x, act_dtype, add=attn))


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: LlamaArchConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary = RotaryEmbedding(arch, max_positions or arch.max_position_embeddings)
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.block_max_rows = 0  # see use_quantized_weights
        self.fused_decode: FusedDecode | None = None  # see use_fused_decode
        self.fused_decode_tiles: FusedDecodeTiles | None = None
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        kv_caches: list[LayerKVCache], metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] for a flat batch of T tokens.

        The residual stream is kept in float32 whatever the weights' dtype: with bfloat16
        weights only the matmuls and attention round, which keeps greedy outputs closer to
        float32's at almost no cost.
        """
        act_dtype = self.activation_dtype(input_ids.shape[0])
        x = self.embed_tokens(input_ids).float()  # a new tensor: the layers add into it
        if self.fused_decode is not None and self.fused_decode.applies(x.shape[0], metadata):
            pending = self.fused_decode.run(self, x, positions, kv_caches, metadata)
            return self.norm(x, act_dtype, add=pending)
        tiles = self.fused_decode_tiles
        if tiles is not None and tiles.applies(x.shape[0], metadata, self.block_max_rows):
            pending = tiles.run(self, x, positions, kv_caches, metadata)
            return self.norm(x, act_dtype, add=pending)
        pending = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            pending = layer(x, pending, positions, self.rotary, kv_cache, metadata, act_dtype)
        return self.norm(x, act_dtype, add=pending)

    def use_fused_decode(self) -> None:
        """Run all layers of a decode step as one C++ call where the layers allow it (see
        ``model/fused_decode``); ``INFLIGHT_FUSED_DECODE=0`` keeps the layer-by-layer path
        (the same outputs, bit for bit). Call once the weights are final."""
        if os.environ.get("INFLIGHT_FUSED_DECODE", "1") == "0":
            self.fused_decode = self.fused_decode_tiles = None
            return
        self.fused_decode = FusedDecode.build(self)
        self.fused_decode_tiles = FusedDecodeTiles.build(self)

    def activation_dtype(self, num_tokens: int) -> torch.dtype:
        """The matmuls' input dtype for a step of ``num_tokens``: the weights' dtype, except
        float32 when the step is small enough for the GGUF block kernel (which computes in
        float32 anyway, so rounding its inputs and outputs to bfloat16 would only lose)."""
        if num_tokens <= self.block_max_rows:
            return torch.float32
        return self.embed_tokens.weight.dtype

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[rows, vocab]`` for the hidden states of the sampled rows."""
        return self.lm_head.forward_float32(hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``compute_logits(hidden).max(dim=-1).indices`` ([rows] int64) without the
        logits, where the output layer's kernel can fuse the argmax (Linear.greedy_argmax;
        -1 for a row it leaves to the logits); else None."""
        return self.lm_head.greedy_argmax(hidden)

    def use_cpu_kernels(self) -> None:
        """Run RMSNorm, RoPE + K/V write and SiLU-mul as fused C++ ops (CPU only)."""
        for module in self.modules():
            if isinstance(module, RMSNorm | Attention | MLP):
                module.fused = True

    def use_quantized_weights(
        self, quantized: Mapping[str, QuantizedWeight], max_rows: int, bf16_dot: bool = False
    ) -> None:
        """Let batches of up to ``max_rows`` tokens read the GGUF blocks of each linear layer
        (fused like the dense weights; a fused layer whose parts differ in type stays dense).
        With ``bf16_dot`` the decoder layers' 4-bit blocks are computed with bfloat16 dot
        products (see ``Linear.use_blocks``); the output layer keeps float32 activations."""
        self.block_max_rows = max_rows
        for linear, blocks in self._linear_blocks(quantized):
            # the output layer keeps float32 activations
            linear.use_blocks(blocks, max_rows, bf16_dot and linear is not self.lm_head)

    def use_gguf_amx_weights(self, quantized: Mapping[str, QuantizedWeight], max_rows: int) -> None:
        """Let bfloat16 steps of up to ``max_rows`` tokens read each decoder linear's 4-bit
        GGUF blocks with AMX tiles (``Linear.use_gguf_amx``: bit-identical to the dense
        bfloat16 weight's AMX kernel, from 6 bits a weight instead of 16). Call after the
        AMX weights."""
        for linear, blocks in self._linear_blocks(quantized):
            if linear is not self.lm_head and blocks is not None and linear.amx is not None:
                linear.use_gguf_amx(blocks, max_rows)

    def _linear_blocks(
        self, quantized: Mapping[str, QuantizedWeight]
    ) -> list[tuple[Linear, QuantizedWeight | None]]:
        """Each linear layer with its GGUF blocks, fused like the dense weights (None where
        a part is missing or the parts differ in type)."""
        embed = "model.embed_tokens.weight"
        head = embed if self.arch.tie_word_embeddings else "lm_head.weight"
        pairs: list[tuple[Linear, QuantizedWeight | None]] = [
            (self.lm_head, _fused_blocks(quantized, [head]))
        ]
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            pairs += [
                (layer.self_attn.qkv_proj,
                 _fused_blocks(quantized, [p + f"self_attn.{x}_proj.weight" for x in "qkv"])),
                (layer.self_attn.o_proj, _fused_blocks(quantized, [p + "self_attn.o_proj.weight"])),
                (layer.mlp.gate_up_proj,
                 _fused_blocks(quantized, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])),
                (layer.mlp.down_proj, _fused_blocks(quantized, [p + "mlp.down_proj.weight"])),
            ]
        return pairs

    @torch.no_grad()
    def load_hf_weights(
        self, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
    ) -> None:
        """Take Hugging Face-named tensors as the parameters (converted to ``dtype`` on
        ``device``), fusing q/k/v and gate/up on the way."""
        params = dict(self.named_parameters())
        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            used.add(name)
            return weights[name]

        def put(param_name: str, tensor: torch.Tensor) -> None:
            param = params[param_name]
            if param.shape != tensor.shape:
                raise ValueError(
                    f"shape mismatch for {param_name}: model {tuple(param.shape)}, "
                    f"checkpoint {tuple(tensor.shape)}"
                )
            param.data = tensor.to(device=device, dtype=dtype)

        put("embed_tokens.weight", take("model.embed_tokens.weight"))
        put("norm.weight", take("model.norm.weight"))
        if not self.arch.tie_word_embeddings:
            put("lm_head.weight", take("lm_head.weight"))
        for i in range(self.arch.num_hidden_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            attn = src + "self_attn."
            put(dst + "self_attn.qkv_proj.weight", _fuse(
                [take(attn + f"{p}_proj.weight") for p in "qkv"]))
            if self.arch.attention_bias:
                put(dst + "self_attn.qkv_proj.bias", _fuse(
                    [take(attn + f"{p}_proj.bias") for p in "qkv"]))
            put(dst + "self_attn.o_proj.weight", take(attn + "o_proj.weight"))
            put(dst + "mlp.gate_up_proj.weight", _fuse(
                [take(src + "mlp.gate_proj.weight"), take(src + "mlp.up_proj.weight")]))
            put(dst + "mlp.down_proj.weight", take(src + "mlp.down_proj.weight"))
            put(dst + "input_layernorm.weight", take(src + "input_layernorm.weight"))
            put(dst + "post_attention_layernorm.weight",
                take(src + "post_attention_layernorm.weight"))
        self.tie_weights()
        ignored = {"lm_head.weight"} if self.arch.tie_word_embeddings else set()
        unused = sorted(set(weights) - used - ignored)
        unused = [n for n in unused if "rotary_emb" not in n]
        if unused:
            raise ValueError(f"checkpoint has tensors this model does not use: {unused[:5]}")


def _fuse(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)`` along dim 0, as a view without a copy where the parts already lie
    one after the other in one storage (the GGUF loader decodes them so)."""
    first = parts[0]
    offset = first.storage_offset()
    adjacent = all(p.is_contiguous() and p.dtype == first.dtype and p.shape[1:] == first.shape[1:]
                   and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                   for p in parts)
    for part in parts:
        adjacent = adjacent and part.storage_offset() == offset
        offset += part.numel()
    if not adjacent:
        return torch.cat(parts)
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def _fused_blocks(
    quantized: Mapping[str, QuantizedWeight], names: list[str]
) -> QuantizedWeight | None:
    """The named weights' blocks stacked by rows, or None unless all exist with one type."""
    parts = [quantized.get(name) for name in names]
    present = [part for part in parts if part is not None]
    if len(present) != len(parts) or len({part.ggml_type for part in present}) != 1:
        return None
    blocks = present[0].blocks if len(present) == 1 else torch.cat([p.blocks for p in present])
    return QuantizedWeight(present[0].ggml_type, blocks)
