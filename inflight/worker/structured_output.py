"""Applying structured-output constraints to a step's logits (the torch side).

Only rows whose request has ``structured_outputs`` are touched: a step without any costs
one pass over the sampled params and nothing else. The constrained rows' bitmasks are
filled together (in parallel, by the manager) and applied in one masked write.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from inflight.sampling_params import SamplingParams

if TYPE_CHECKING:
    from inflight.structured_output.manager import StructuredOutputManager


def mask_constrained_rows(
    manager: StructuredOutputManager, logits: torch.Tensor, request_ids: list[str],
    params: list[SamplingParams],
) -> dict[str, str]:
    """Set, in place, -inf at every token a constrained row's grammar forbids now.

    Returns the requests that cannot be constrained (their grammar failed to compile);
    their rows are left as they are and the caller drops their tokens."""
    rows = [i for i, p in enumerate(params) if p.structured_outputs is not None]
    if not rows:
        return {}
    bitmask, failed = manager.fill_bitmask([request_ids[i] for i in rows])
    apply_token_bitmask(logits, rows, bitmask)
    return failed


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> None:
    """logits[rows[k], t] = -inf where bit t of ``bitmask[k]`` is 0 (see the manager's
    layout); tokens past the bitmask's width are forbidden too."""
    vocab = logits.shape[-1]
    # little-endian int32 words -> bytes -> bits in token order
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    allowed_t = torch.from_numpy(allowed).to(logits.device).bool()
    if allowed_t.shape[1] < vocab:
        allowed_t = torch.nn.functional.pad(allowed_t, (0, vocab - allowed_t.shape[1]))
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed_t, float("-inf"))
