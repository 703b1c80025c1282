"""Per-step attention inputs, built once per step and shared by every layer.

The step's tokens are one flat batch of ``T`` tokens from ``S`` sequences, each sequence a
contiguous run (a prompt chunk or a single decode token)::

    tokens:          | seq 0 chunk (5) | seq 1 (1) | seq 2 (1) |
    query_start:     [0,               5,          6,          7]
    seq_lens:        context length of each sequence *after* this step's tokens
    slot_mapping[t]: block_table[pos_t // block_size] * block_size + pos_t % block_size

Sequences are served in groups so that decode tokens never pay for the padding of a
long prompt chunk: decode tokens go to the varlen kernel (:class:`VarlenGroup`) when the
C++ backend is available; prompt chunks that start their sequence to PyTorch's
scaled-dot-product attention one prompt at a time inside one C++ call
(:class:`PromptGroup`); other prompt chunks to the varlen kernel or to padded
scaled-dot-product attention (:class:`PaddedGroup`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PaddedGroup:
    """Sequences attended to in one padded SDPA call.

    ``token_index[s, i]`` is the flat index of the i-th query token of sequence s (padding
    points at token 0 and is masked); ``mask[s, 0, i, j]`` says query i may see key j.
    """

    token_index: torch.Tensor  # [S, max_q] int64
    valid: torch.Tensor  # [S, max_q] bool: real (not padding) query tokens
    block_tables: torch.Tensor  # [S, max_blocks] int64
    mask: torch.Tensor | None  # [S, 1, max_q, max_blocks * block_size] bool
    # Every sequence starts at position 0 (a fresh prompt chunk): its keys are exactly this
    # step's tokens, so attention needs no gather and is plain causal (right padding is
    # only ever seen by padded queries, which are discarded).
    fresh: bool = False


@dataclass(frozen=True, slots=True)
class VarlenGroup:
    """Sequences attended to by the varlen paged kernel, reading K/V in place."""

    token_index: torch.Tensor | None  # [N] int64 flat indices; None means all T tokens
    block_tables: torch.Tensor  # [S, max_blocks] int32
    query_start: torch.Tensor  # [S + 1] int32, offsets into the group's tokens
    seq_lens: torch.Tensor  # [S] int32


@dataclass(frozen=True, slots=True)
class PromptGroup:
    """Fresh prompt chunks (position 0 onwards): causal attention over their own tokens."""

    starts: torch.Tensor  # [S] int64 flat index of each chunk's first token
    lengths: torch.Tensor  # [S] int64


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V is written
    slot_block: torch.Tensor  # [T] int64: slot_mapping // block_size
    slot_offset: torch.Tensor  # [T] int64: slot_mapping % block_size
    decode: PaddedGroup | VarlenGroup | None
    prefill: PaddedGroup | VarlenGroup | None
    prompts: PromptGroup | None = None
