"""Log probabilities from the model's raw logits (before temperature, penalties, biases and
truncation: vLLM's default ``raw_logprobs``), only for the rows that ask for them.

For each position: the log_softmax of the raw logits, the given (sampled or prompt)
token's logprob and rank (1 + how many tokens are strictly more likely), and the top k
tokens, best first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from inflight.core.interface import TokenLogprobs

# Prompt positions turned into [rows, vocab] logprobs at once (bounds the memory used).
PROMPT_LOGPROBS_CHUNK = 512


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]
) -> list[TokenLogprobs]:
    """logits: [R, V] raw; ``token_ids[r]`` the token whose logprob row r reports;
    ``num_top[r]`` how many of the top tokens row r lists."""
    if not len(token_ids):
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.tensor(list(token_ids), device=logits.device).unsqueeze(1)
    chosen_logprobs = logprobs.gather(1, chosen)
    ranks = (logprobs > chosen_logprobs).sum(dim=-1) + 1
    k = max(num_top)
    top_values: list[list[float]] = [[] for _ in token_ids]
    top_ids: list[list[int]] = [[] for _ in token_ids]
    if k > 0:
        top = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    return [
        TokenLogprobs(
            token_id=token, logprob=value, rank=rank,
            top_token_ids=tuple(ids[:n]), top_logprobs=tuple(values[:n]),
        )
        for token, value, rank, ids, values, n in zip(
            token_ids, chosen_logprobs.squeeze(1).tolist(), ranks.tolist(),
            top_ids, top_values, num_top, strict=True,
        )
    ]


def prompt_token_logprobs(
    hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor],
    targets: Sequence[int], num_top: int,
) -> list[TokenLogprobs]:
    """hidden: [len(targets), H], the hidden states of the positions predicting
    ``targets``; logits are computed a chunk of positions at a time."""
    entries: list[TokenLogprobs] = []
    for start in range(0, len(targets), PROMPT_LOGPROBS_CHUNK):
        end = min(start + PROMPT_LOGPROBS_CHUNK, len(targets))
        logits = compute_logits(hidden[start:end])
        entries.extend(token_logprobs(logits, targets[start:end], [num_top] * (end - start)))
    return entries
