"""The KV cache tensors: one preallocated K and one V tensor per layer.

::

    k_cache[layer]: [num_blocks, num_kv_heads, head_dim, block_size]   keys transposed
    v_cache[layer]: [num_blocks, block_size, num_kv_heads, head_dim]

Keys are stored transposed inside a block so the CPU kernel can score a whole block of
keys with broadcast FMAs; :func:`key_token_view` gives the logical
``[num_blocks, block_size, num_kv_heads, head_dim]`` view that everything else uses.
Zero-initialised: padded attention reads of never-written slots must be finite.
"""

from __future__ import annotations

import torch

from inflight.model.arch import LlamaArchConfig


def bytes_per_block(arch: LlamaArchConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_hidden_layers * block_size * arch.num_key_value_heads * arch.head_dim * element


def allocate_kv_cache(
    arch: LlamaArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    kv_heads, head_dim = arch.num_key_value_heads, arch.head_dim
    return [
        (
            torch.zeros((num_blocks, kv_heads, head_dim, block_size), dtype=dtype, device=device),
            torch.zeros((num_blocks, block_size, kv_heads, head_dim), dtype=dtype, device=device),
        )
        for _ in range(arch.num_hidden_layers)
    ]


def key_token_view(k_cache: torch.Tensor) -> torch.Tensor:
    """The key cache as [num_blocks, block_size, num_kv_heads, head_dim] (a strided view)."""
    return k_cache.permute(0, 3, 1, 2)
