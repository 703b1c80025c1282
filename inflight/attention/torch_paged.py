"""Paged attention over a step's groups of sequences.

KV cache layout, one tensor pair per layer (see ``worker/kv_cache.py``)::

    k_cache: [num_blocks, num_kv_heads, head_dim, block_size]   (keys transposed)
    v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block * block_size + offset

An int8 cache also has per-token, per-head scales (``k_scale``/``v_scale``
``[num_blocks, num_kv_heads, block_size]``, see :func:`quantize_kv`); the functions take
them as optional arguments.

Each step first writes the new tokens' K/V at their slots (:func:`write_kv`, or the fused
C++ ``rope_write_kv`` on the CPU). Then each group of sequences
is served by one call: a :class:`VarlenGroup` by the C++ kernel that walks block tables in
place; a :class:`PaddedGroup` by gathering every sequence's context through its block
table and running padded scaled-dot-product attention with a causal mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inflight.attention.metadata import AttentionMetadata, PaddedGroup, VarlenGroup
from inflight.kernels import cpu as cpu_kernels
from inflight.worker.kv_cache import key_token_view, scale_token_view


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 round(x / scale), scale [...]) with scale = max|x| / 127 (0 for
    an all-zero head). The C++ ``rope_write_kv`` does the same arithmetic."""
    x32 = x.float()
    scale = x32.abs().amax(dim=-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    quantized = torch.where(scale[..., None] > 0, torch.round(x32 / safe[..., None]), 0.0)
    return quantized.to(torch.int8), scale


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    metadata: AttentionMetadata, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    where = (metadata.slot_block, metadata.slot_offset)
    if k_cache.dtype == torch.int8:
        assert k_scale is not None and v_scale is not None, "an int8 cache needs its scales"
        (k, k_scales), (v, v_scales) = quantize_kv(k), quantize_kv(v)
        scale_token_view(k_scale)[where] = k_scales
        scale_token_view(v_scale)[where] = v_scales
    key_token_view(k_cache)[where] = k.to(k_cache.dtype)
    num_slots = v_cache.shape[0] * v_cache.shape[1]
    v_cache.view(num_slots, *v_cache.shape[2:]).index_copy_(
        0, metadata.slot_mapping, v.to(v_cache.dtype)
    )


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor,
    metadata: AttentionMetadata, scale: float,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D] for this step's tokens, already written to the
    caches (:func:`write_kv`). Returns [T, H, D]."""
    scales = (k_scale, v_scale)
    only = metadata.decode if metadata.prefill is None and metadata.prompts is None else None
    if isinstance(only, VarlenGroup) and only.token_index is None:
        return _varlen(q, k_cache, v_cache, only, scale, scales)  # the common decode-only step
    out = torch.empty_like(q)
    if metadata.prompts is not None:
        prompts = metadata.prompts
        cpu_kernels.prompt_attention(q, k, v, prompts.starts, prompts.lengths, scale, out)
    for group in (metadata.decode, metadata.prefill):
        if isinstance(group, VarlenGroup):
            _attend_varlen(q, k_cache, v_cache, group, scale, scales, out)
        elif isinstance(group, PaddedGroup):
            _attend_padded(q, k, v, k_cache, v_cache, group, scale, scales, out)
    return out


Scales = tuple[torch.Tensor | None, torch.Tensor | None]


def _attend_varlen(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    group: VarlenGroup, scale: float, scales: Scales, out: torch.Tensor,
) -> None:
    result = _varlen(q, k_cache, v_cache, group, scale, scales)
    if group.token_index is None:
        out.copy_(result)
    else:
        out[group.token_index] = result


def _varlen(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: VarlenGroup,
    scale: float, scales: Scales,
) -> torch.Tensor:
    q_group = q if group.token_index is None else q[group.token_index]
    if q_group.dtype not in (torch.float32, torch.bfloat16):
        q_group = q_group.float()
    # bfloat16 queries: bfloat16 dot products where they pay, else float32 FMAs on the
    # queries' values (bf16_dots' default)
    return cpu_kernels.paged_attention(
        q_group.contiguous(), k_cache, v_cache, group.block_tables,
        group.query_start, group.seq_lens, scale, *scales,
    ).to(q.dtype)


def _attend_padded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, group: PaddedGroup, scale: float, scales: Scales,
    out: torch.Tensor,
) -> None:
    # [S, max_q, H, D] -> [S, H, max_q, D]
    q_padded = q[group.token_index].transpose(1, 2)
    if group.fresh:
        keys, values = k[group.token_index], v[group.token_index]  # [S, max_q, KVH, D]
    else:
        num_seqs, max_blocks = group.block_tables.shape
        block_size = v_cache.shape[1]
        # [S, max_blocks, bs, KVH, D] -> [S, max_kv, KVH, D]
        values = v_cache[group.block_tables]  # [S, max_blocks, bs, KVH, D]
        keys = key_token_view(k_cache)[group.block_tables]
        k_scale, v_scale = scales
        if k_scale is not None and v_scale is not None:  # int8: dequantise what was gathered
            keys = keys.float() * scale_token_view(k_scale)[group.block_tables][..., None]
            values = values.float() * scale_token_view(v_scale)[group.block_tables][..., None]
        values = values.reshape(num_seqs, max_blocks * block_size, *v_cache.shape[2:])
        keys = keys.reshape(values.shape)
    attn = F.scaled_dot_product_attention(
        q_padded, keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype),
        attn_mask=group.mask, is_causal=group.fresh, scale=scale, enable_gqa=True,
    )
    flat_index = group.token_index[group.valid]
    out[flat_index] = attn.transpose(1, 2)[group.valid]
