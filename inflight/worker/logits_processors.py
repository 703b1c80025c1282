"""Per-request logits transforms, batched: allowed tokens, bad words, logit bias, penalties.

Applied to the rows of one step's logits whose requests ask for any of them (vLLM's
order): ``allowed_token_ids`` (every other token to -inf), ``bad_words``, ``logit_bias``,
then ``repetition_penalty``, ``frequency_penalty`` and ``presence_penalty``. Each kind is
one batched tensor op over the rows that use it; rows that use none are not touched (and
a batch where no row uses any costs one Python check per row).

State is kept per request and updated incrementally: a dense count row of the tokens it
generated (``record`` adds each sampled token), a mask of its prompt's tokens (built once,
for the repetition penalty), the last few generated tokens (for multi-token bad words),
and its allowed-token mask. Nothing is recounted from the whole sequence. The state lives
until the request finishes (``forget``), so it survives preemption unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from inflight.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ProcessorRow:
    """What the processors need to know about one row of the logits."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: Sequence[int] = ()  # needed only with repetition_penalty


@dataclass(slots=True)
class _RequestState:
    output_counts: torch.Tensor | None = None  # [V] float32, with penalties
    prompt_mask: torch.Tensor | None = None  # [V] bool, with repetition_penalty
    allowed_mask: torch.Tensor | None = None  # [V] bool, with allowed_token_ids
    recent: list[int] = field(default_factory=list)  # last generated tokens, for bad words
    recent_limit: int = 0


class LogitsProcessors:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._states: dict[str, _RequestState] = {}

    def forget(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._states.pop(request_id, None)

    def apply(self, logits: torch.Tensor, rows: Sequence[ProcessorRow]) -> torch.Tensor:
        """The transformed logits ([N, V], a new tensor when any row is transformed)."""
        chosen = [i for i, row in enumerate(rows) if row.params.needs_logits_processing]
        if not chosen:
            return logits
        logits = logits.clone()
        states = {i: self._state(rows[i]) for i in chosen}
        self._apply_allowed(logits, rows, chosen, states)
        self._apply_bad_words(logits, rows, chosen, states)
        self._apply_logit_bias(logits, rows, chosen)
        self._apply_penalties(logits, rows, chosen, states)
        return logits

    def record(self, rows: Sequence[ProcessorRow], token_ids: Sequence[int | None]) -> None:
        """Count each row's sampled token (None: the row produced no token)."""
        for row, token in zip(rows, token_ids, strict=True):
            state = self._states.get(row.request_id)
            if state is None or token is None:
                continue
            if state.output_counts is not None:
                state.output_counts[token] += 1
            if state.recent_limit:
                state.recent.append(token)
                del state.recent[: -state.recent_limit]

    # ------------------------------------------------------------------ state

    def _state(self, row: ProcessorRow) -> _RequestState:
        state = self._states.get(row.request_id)
        if state is not None:
            return state
        params = row.params
        state = _RequestState()
        vocab, device = self.vocab_size, self.device
        if params.has_penalties:
            state.output_counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        if params.repetition_penalty != 1.0:
            state.prompt_mask = torch.zeros(vocab, dtype=torch.bool, device=device)
            if row.prompt_token_ids:
                ids = torch.tensor(list(row.prompt_token_ids), device=device)
                state.prompt_mask[ids] = True
        if params.allowed_token_ids is not None:
            state.allowed_mask = torch.zeros(vocab, dtype=torch.bool, device=device)
            state.allowed_mask[torch.tensor(params.allowed_token_ids, device=device)] = True
        longest = max((len(w) for w in params._bad_words_token_ids), default=0)
        state.recent_limit = max(0, longest - 1)
        self._states[row.request_id] = state
        return state

    # ------------------------------------------------------------------ transforms

    def _apply_allowed(
        self, logits: torch.Tensor, rows: Sequence[ProcessorRow], chosen: list[int],
        states: dict[int, _RequestState],
    ) -> None:
        picked = [i for i in chosen if states[i].allowed_mask is not None]
        if not picked:
            return
        masks = torch.stack([states[i].allowed_mask for i in picked])  # type: ignore[misc]
        index = torch.tensor(picked, device=logits.device)
        logits[index] = logits[index].masked_fill(~masks, float("-inf"))

    def _apply_bad_words(
        self, logits: torch.Tensor, rows: Sequence[ProcessorRow], chosen: list[int],
        states: dict[int, _RequestState],
    ) -> None:
        """Ban a word's last token where the word's other tokens were just generated."""
        pairs: list[tuple[int, int]] = []
        for i in chosen:
            recent = states[i].recent
            for word in rows[i].params._bad_words_token_ids:
                prefix = list(word[:-1])
                if not prefix or recent[len(recent) - len(prefix) :] == prefix:
                    pairs.append((i, word[-1]))
        _fill(logits, pairs, float("-inf"))

    def _apply_logit_bias(
        self, logits: torch.Tensor, rows: Sequence[ProcessorRow], chosen: list[int]
    ) -> None:
        triples = [
            (i, token, bias)
            for i in chosen
            for token, bias in (rows[i].params.logit_bias or {}).items()
        ]
        if not triples:
            return
        row_ids, cols, values = zip(*triples, strict=True)
        index = (
            torch.tensor(row_ids, device=logits.device),
            torch.tensor(cols, device=logits.device),
        )
        bias = torch.tensor(values, dtype=logits.dtype, device=logits.device)
        logits.index_put_(index, bias, accumulate=True)

    def _apply_penalties(
        self, logits: torch.Tensor, rows: Sequence[ProcessorRow], chosen: list[int],
        states: dict[int, _RequestState],
    ) -> None:
        picked = [i for i in chosen if rows[i].params.has_penalties]
        if not picked:
            return
        device = logits.device
        index = torch.tensor(picked, device=device)
        counts = torch.stack([states[i].output_counts for i in picked])  # type: ignore[misc]
        values = logits[index]
        params = [rows[i].params for i in picked]
        repetition = torch.tensor([p.repetition_penalty for p in params], device=device)
        if bool((repetition != 1.0).any()):
            no_prompt = torch.zeros_like(counts[0], dtype=torch.bool)
            masks = [states[i].prompt_mask for i in picked]
            prompt = torch.stack([m if m is not None else no_prompt for m in masks])
            seen = prompt | (counts > 0)
            rep = repetition.unsqueeze(1)
            penalised = torch.where(values > 0, values / rep, values * rep)
            values = torch.where(seen, penalised, values)
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)
        presence = torch.tensor([p.presence_penalty for p in params], device=device)
        values = values - frequency.unsqueeze(1) * counts
        values = values - presence.unsqueeze(1) * (counts > 0).to(values.dtype)
        logits[index] = values


def _fill(logits: torch.Tensor, pairs: list[tuple[int, int]], value: float) -> None:
    if not pairs:
        return
    rows, cols = zip(*pairs, strict=True)
    index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
    logits.index_put_(index, torch.tensor(value, dtype=logits.dtype, device=logits.device))
