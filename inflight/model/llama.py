"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral without sliding window, Qwen2).

Runs one step over a flat batch of tokens from many sequences; attention reads and writes
K/V through the paged cache. Q/K/V and gate/up projections are fused into single matmuls.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from inflight.attention.metadata import AttentionMetadata
from inflight.attention.torch_paged import paged_attention
from inflight.model.arch import LlamaArchConfig


class Linear(nn.Module):
    """``nn.Linear`` without random initialisation: weights always come from a checkpoint."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 as transformers does, then cast to the weights' dtype (the
        # residual stream may be float32 while the matmuls run in bfloat16).
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(self.weight.dtype)


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

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
        kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, arch: LlamaArchConfig) -> None:
        super().__init__()
        self.intermediate_size = arch.intermediate_size
        self.gate_up_proj = Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, arch: LlamaArchConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
        kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, kv_cache, metadata)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: LlamaArchConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary = RotaryEmbedding(arch, max_positions or arch.max_position_embeddings)
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] for a flat batch of T tokens.

        The residual stream is kept in float32 whatever the weights' dtype: with bfloat16
        weights only the matmuls and attention round, which keeps greedy outputs closer to
        float32's at almost no cost.
        """
        x = self.embed_tokens(input_ids).float()
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, positions, self.rotary, kv_cache, metadata)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

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
            put(dst + "self_attn.qkv_proj.weight", torch.cat(
                [take(attn + f"{p}_proj.weight") for p in "qkv"]))
            if self.arch.attention_bias:
                put(dst + "self_attn.qkv_proj.bias", torch.cat(
                    [take(attn + f"{p}_proj.bias") for p in "qkv"]))
            put(dst + "self_attn.o_proj.weight", take(attn + "o_proj.weight"))
            put(dst + "mlp.gate_up_proj.weight", torch.cat(
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
