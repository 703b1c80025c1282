"""Turn a ``SchedulerOutput`` into the flat tensors one forward pass needs.

Given ``vocab_size`` and ``num_kv_blocks``, the builder also checks every request's token
ids and block ids (vectorised, on the flat arrays) and raises :class:`InvalidInputsError`
naming the requests whose inputs the model cannot run, so the runner can fail those
alone instead of the whole step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from inflight.attention.metadata import (
    AttentionMetadata,
    PaddedGroup,
    PromptGroup,
    VarlenGroup,
)
from inflight.core.interface import ScheduledRequest, SchedulerOutput


class InvalidInputsError(ValueError):
    """Some requests' inputs are out of range; ``reasons`` maps request id -> why."""

    def __init__(self, reasons: dict[str, str]) -> None:
        super().__init__("; ".join(f"{rid}: {why}" for rid, why in reasons.items()))
        self.reasons = reasons


@dataclass(frozen=True, slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attention: AttentionMetadata
    # Flat index of the last token of every sequence that samples this step.
    logits_indices: torch.Tensor  # [N]
    sampled: list[ScheduledRequest]  # the N sequences, in logits order
    scheduled: list[ScheduledRequest]  # every sequence of the step, in token order
    query_start: list[int]  # flat index of each scheduled sequence's first token


def build_model_inputs(
    scheduler_output: SchedulerOutput, block_size: int, device: torch.device,
    varlen_decode: bool = False, varlen_prefill: bool = False,
    vocab_size: int | None = None, num_kv_blocks: int | None = None,
) -> ModelInputs:
    """Flat inputs for one step; ``varlen_*`` route a group to the C++ varlen kernel (with
    ``varlen_decode`` alone, prompt chunks go to it too when they are all short).

    Raises :class:`InvalidInputsError` for requests with a token id outside
    ``[0, vocab_size)`` or a block id outside ``[0, num_kv_blocks)``."""
    items = scheduler_output.scheduled
    lengths = np.fromiter((s.num_tokens for s in items), dtype=np.int64, count=len(items))
    starts = np.fromiter((s.start_position for s in items), dtype=np.int64, count=len(items))
    query_start = np.zeros(len(items) + 1, dtype=np.int64)
    np.cumsum(lengths, out=query_start[1:])
    total = int(query_start[-1])

    input_ids = np.fromiter(
        (t for s in items for t in s.token_ids), dtype=np.int64, count=total
    )
    # position of each token: its sequence's start + offset within the chunk
    seq_of_token = np.repeat(np.arange(len(items)), lengths)
    positions = starts[seq_of_token] + (np.arange(total) - query_start[seq_of_token])

    block_tables = _pad_block_tables(items)
    _check_ranges(items, input_ids, seq_of_token, block_tables, vocab_size, num_kv_blocks)
    block_of_token = block_tables[seq_of_token, positions // block_size]
    slot_mapping = block_of_token * block_size + positions % block_size

    is_decode = lengths == 1
    prefill = np.nonzero(~is_decode)[0]
    prompts = None
    if varlen_decode and not varlen_prefill:
        # Chunks that start their prompt attend only to themselves: PyTorch's SDPA, one
        # prompt at a time in one C++ call (see kernels/csrc/prompt_attention.cpp).
        fresh = prefill[starts[prefill] == 0]
        if len(fresh):
            prompts = PromptGroup(
                starts=torch.from_numpy(query_start[fresh]).to(device),
                lengths=torch.from_numpy(lengths[fresh]).to(device),
            )
            prefill = prefill[starts[prefill] > 0]
    groups: dict[str, PaddedGroup | VarlenGroup | None] = {}
    for name, chosen, varlen in (
        ("decode", np.nonzero(is_decode)[0], varlen_decode),
        ("prefill", prefill, varlen_prefill or (varlen_decode and _short_chunks(lengths[prefill]))),
    ):
        if not len(chosen):
            groups[name] = None
        elif varlen:
            groups[name] = _varlen_group(
                chosen, lengths, starts, query_start, block_tables, total, device
            )
        else:
            groups[name] = _padded_group(
                chosen, lengths, starts, query_start, block_tables, block_size, device
            )

    sampled = [s for s in items if s.sample]
    logits_indices = np.array(
        [query_start[i + 1] - 1 for i, s in enumerate(items) if s.sample], dtype=np.int64
    )

    def to_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device)

    return ModelInputs(
        input_ids=to_device(input_ids),
        positions=to_device(positions),
        attention=AttentionMetadata(
            slot_mapping=to_device(slot_mapping),
            slot_block=to_device(block_of_token),
            slot_offset=to_device(positions % block_size),
            decode=groups["decode"],
            prefill=groups["prefill"],
            prompts=prompts,
        ),
        logits_indices=to_device(logits_indices),
        sampled=sampled,
        scheduled=list(items),
        query_start=query_start.tolist(),
    )


def _check_ranges(
    items: list[ScheduledRequest], input_ids: np.ndarray, seq_of_token: np.ndarray,
    block_tables: np.ndarray, vocab_size: int | None, num_kv_blocks: int | None,
) -> None:
    """Raise InvalidInputsError naming each request whose ids the model cannot index."""
    reasons: dict[str, str] = {}
    if vocab_size is not None:
        bad_tokens = (input_ids < 0) | (input_ids >= vocab_size)
        if bad_tokens.any():
            for token, row in zip(input_ids[bad_tokens], seq_of_token[bad_tokens], strict=True):
                reasons.setdefault(
                    items[row].request_id,
                    f"Token id {int(token)} is out of vocabulary (size {vocab_size})",
                )
    if num_kv_blocks is not None:
        # Padding is 0, always a valid block id.
        bad_rows = ((block_tables < 0) | (block_tables >= num_kv_blocks)).any(axis=1)
        for row in np.nonzero(bad_rows)[0]:
            reasons.setdefault(
                items[row].request_id,
                f"block ids {items[row].block_ids} are outside the KV cache ({num_kv_blocks})",
            )
    if reasons:
        raise InvalidInputsError(reasons)


# Prompt chunks that continue a prompt (chunked prefill): PyTorch's flash SDPA over the
# gathered context is the faster kernel on long chunks, the C++ varlen kernel on short
# ones, where SDPA's padding of a dozen prompts of different lengths to the longest costs
# more than its speed gains. Measured when every prompt chunk went this way: `mixed`
# (chunks of 50-600 tokens) took 104 s with SDPA and 90 s with varlen; 8 prompts of 2000
# tokens took 12.8 s with SDPA and 19.4 s with varlen.
VARLEN_PREFILL_MAX_CHUNK = 1024


def _short_chunks(q_lens: np.ndarray) -> bool:
    return len(q_lens) > 0 and int(q_lens.max()) <= VARLEN_PREFILL_MAX_CHUNK


def _pad_block_tables(items: list[ScheduledRequest]) -> np.ndarray:
    width = max(len(s.block_ids) for s in items)
    table = np.zeros((len(items), width), dtype=np.int64)
    for row, s in enumerate(items):
        table[row, : len(s.block_ids)] = s.block_ids
    return table


def _varlen_group(
    chosen: np.ndarray, lengths: np.ndarray, starts: np.ndarray, query_start: np.ndarray,
    block_tables: np.ndarray, total_tokens: int, device: torch.device,
) -> VarlenGroup:
    q_lens = lengths[chosen]
    group_start = np.zeros(len(chosen) + 1, dtype=np.int32)
    np.cumsum(q_lens, out=group_start[1:])
    token_index = None
    if int(group_start[-1]) != total_tokens:  # only part of the step's tokens
        token_index = torch.from_numpy(
            np.concatenate([np.arange(query_start[i], query_start[i + 1]) for i in chosen])
        ).to(device)
    return VarlenGroup(
        token_index=token_index,
        block_tables=torch.from_numpy(block_tables[chosen].astype(np.int32)).to(device),
        query_start=torch.from_numpy(group_start).to(device),
        seq_lens=torch.from_numpy((starts[chosen] + q_lens).astype(np.int32)).to(device),
    )


def _padded_group(
    chosen: np.ndarray, lengths: np.ndarray, starts: np.ndarray, query_start: np.ndarray,
    block_tables: np.ndarray, block_size: int, device: torch.device,
) -> PaddedGroup:
    q_lens = lengths[chosen]
    max_q = int(q_lens.max())
    context_lens = starts[chosen] + q_lens
    num_blocks = int(-(-context_lens.max() // block_size))
    max_kv = num_blocks * block_size

    offsets = np.arange(max_q)
    valid = offsets[None, :] < q_lens[:, None]  # [S, max_q]
    token_index = np.where(valid, query_start[chosen][:, None] + offsets[None, :], 0)
    q_positions = starts[chosen][:, None] + offsets[None, :]  # [S, max_q]
    fresh = bool((starts[chosen] == 0).all())
    mask = None
    if not fresh:
        key_positions = np.arange(max_kv)
        # causal over cached prefix + chunk; padded query rows may see key 0 (avoids NaN)
        mask = key_positions[None, None, :] <= q_positions[:, :, None]
        mask[~valid] = False
        mask[..., 0] = True

    def to_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device)

    return PaddedGroup(
        token_index=to_device(token_index),
        valid=to_device(valid),
        block_tables=to_device(block_tables[chosen, :num_blocks]),
        mask=None if mask is None else to_device(mask[:, None, :, :]),
        fresh=fresh,
    )
