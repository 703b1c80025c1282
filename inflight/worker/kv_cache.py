"""The KV cache tensors: one preallocated K and one V tensor per layer.

::

    k_cache[layer], v_cache[layer]: [num_blocks, block_size, num_kv_heads, head_dim]

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
    shape = (num_blocks, block_size, arch.num_key_value_heads, arch.head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(arch.num_hidden_layers)
    ]
