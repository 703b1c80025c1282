"""Batched sampling from the logits of the sequences that sample this step.

Greedy rows take the argmax. Random rows apply temperature, min-p, top-k and top-p, in
vLLM's order (min-p is one of its logits processors, applied before its top-k/top-p
sampler, so top-p measures the mass of what min-p and top-k left), then draw by inverse
transform sampling: one uniform number per row, located in the row's
cumulative distribution (float64, so that even the vocabulary's least likely tokens keep
their probability). Rows with a ``seed`` draw their number from their own generator, so
their tokens do not depend on what else is in the batch. (The exponential race that GPU
engines use, argmax of p / Exp(1) noise, needs a random number per vocabulary entry:
56 ms a step for 49 rows of SmolLM2's 49,152 on 2 CPU cores, against 5 ms for this.)

Before either, ``suppressed`` token ids (stop and EOS ids of requests below their
``min_tokens``) are set to -inf in one indexed write for the whole batch; rows without
any are untouched, so their tokens are exactly what they would be otherwise.

A row whose own sampler state cannot be made (its seeded generator) fails alone: it is
reported in ``SamplerOutput.failed`` and the other rows' tokens are unaffected. Random
rows whose logits are not finite (+inf, NaN: an extreme repetition_penalty, a broken model)
are sampled as softmax's limit (:func:`_limit_of_softmax`); one with no token left fails
alone the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from inflight.kernels import cpu as cpu_kernels
from inflight.sampling_params import NO_TOKEN_LEFT, SamplingParams

# torch.Generator.manual_seed takes [-2**63, 2**64 - 1]; reducing modulo 2**64 gives the
# very same stream for every seed in that range and can never overflow.
_SEED_MODULUS = 2**64


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row; a failed row's entry is meaningless
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why it failed


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._generators.pop(request_id, None)

    def sample(
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams],
        suppressed: Sequence[Sequence[int]] | None = None,
    ) -> SamplerOutput:
        """logits: [N, V] float32, one row per sampled sequence; ``suppressed[i]``: token
        ids row i may not produce. Returns N token ids and the rows that failed."""
        if suppressed is not None:
            logits = _suppress(logits, suppressed)
        tokens = _greedy_tokens(logits)
        failed: dict[str, str] = {}
        _check_greedy_rows(logits, tokens, request_ids, params, failed)
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            chosen = self._sample_random(
                logits[rows],
                [request_ids[i] for i in random_rows],
                [params[i] for i in random_rows],
                failed,
            )
            tokens[rows] = chosen
        return SamplerOutput(tokens.tolist(), failed)

    def _sample_random(
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams],
        failed: dict[str, str],
    ) -> torch.Tensor:
        temperature = torch.tensor([p.temperature for p in params], device=logits.device)
        logits = logits / temperature.unsqueeze(1)
        logits, empty = _limit_of_softmax(logits)
        for row in empty:  # its (meaningless) token is drawn from zeros: in range
            failed[request_ids[row]] = _NO_TOKEN_MESSAGE
        logits = _apply_min_p(logits, [p.min_p for p in params])
        logits = _apply_top_k(logits, [p.top_k for p in params])
        probs = _apply_top_p(logits.softmax(dim=-1), [p.top_p for p in params])
        uniform = torch.rand(len(params), dtype=torch.float64, device=logits.device)
        for row, (request_id, p) in enumerate(zip(request_ids, params, strict=True)):
            if p.seed is not None:
                try:
                    generator = self._generator(request_id, p.seed)
                    uniform[row] = torch.rand(
                        (), dtype=torch.float64, device=logits.device, generator=generator
                    )
                except Exception as error:  # this request's own state: fail it alone
                    self._generators.pop(request_id, None)
                    failed[request_id] = f"could not prepare the sampler for seed={p.seed}: {error}"
        return inverse_transform_sample(probs, uniform)

    def _generator(self, request_id: str, seed: int) -> torch.Generator:
        generator = self._generators.get(request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed % _SEED_MODULUS)
            self._generators[request_id] = generator
        return generator


_NO_TOKEN_MESSAGE = (
    f"{NO_TOKEN_LEFT}: every logit is -inf or NaN after this request's sampling parameters "
    "(allowed_token_ids, bad_words, min_tokens' suppressed stop and EOS ids, penalties, "
    "logit_bias)"
)


def _check_greedy_rows(
    logits: torch.Tensor, tokens: torch.Tensor, request_ids: list[str],
    params: list[SamplingParams], failed: dict[str, str],
) -> None:
    """Greedy rows whose every logit is -inf (nothing allowed is left) fail alone instead
    of emitting id 0. One gather for the batch. (A NaN row keeps PyTorch's argmax, the
    NaN's index, as transformers would take it.)"""
    picked = logits.gather(1, tokens.unsqueeze(1)).squeeze(1)
    for row in (picked == float("-inf")).nonzero().flatten().tolist():
        if params[row].is_greedy:  # random rows: _limit_of_softmax
            failed[request_ids[row]] = _NO_TOKEN_MESSAGE


def _limit_of_softmax(logits: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Rows with non-finite logits ``[N, V]`` made samplable, as softmax's limit: NaN counts
    as -inf, and where a row has +inf logits (a repetition_penalty below float32's range
    divides by 0.0) those tokens share its mass equally and the rest get none. Without this, the
    row's probabilities are NaN and the inverse transform returns index V, past the
    vocabulary. Returns the logits and the rows left with no token at all (every logit -inf
    or NaN), which are set to zeros so that a token can still be drawn in range; finite
    rows are returned untouched (one check for the whole batch)."""
    if bool(torch.isfinite(logits).all()):
        return logits, []
    neg_inf = torch.tensor(float("-inf"), device=logits.device, dtype=logits.dtype)
    logits = torch.where(torch.isnan(logits), neg_inf, logits)
    positive = logits == float("inf")
    rows = positive.any(dim=1, keepdim=True)
    logits = torch.where(rows, torch.where(positive, torch.zeros_like(logits), neg_inf), logits)
    empty = (logits == float("-inf")).all(dim=1)
    logits = torch.where(empty.unsqueeze(1), torch.zeros_like(logits), logits)
    return logits, empty.nonzero().flatten().tolist()


def inverse_transform_sample(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Token ids ``[N]`` drawn from ``probs [N, V]`` (rows need not sum to 1: top-p and
    min-p zero some entries) with ``uniform [N]`` float64 numbers in [0, 1): row i takes
    the first token whose cumulative mass exceeds ``uniform[i]`` times the row's total.

    The target is kept strictly below the total, so a token of zero probability is never
    taken, not even when the product rounds up or the last tokens were zeroed.
    """
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniform.unsqueeze(1) * total, torch.nextafter(total, total.new_zeros(())))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[N] int64: each row's first index of its maximum, as ``logits.max(dim=-1).indices``
    (~2x faster than ``argmax`` on CPU). On CPU the C++ kernel (csrc/greedy_argmax.cpp:
    ~0.3 against 0.8 ms for 57 rows of 49,152); rows it leaves to PyTorch (a NaN) as
    PyTorch has them."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or not cpu_kernels.available():
        return logits.max(dim=-1).indices
    tokens = cpu_kernels.greedy_argmax(logits)
    nan_rows = (tokens < 0).nonzero().flatten()
    if len(nan_rows) > 0:
        tokens[nan_rows] = logits[nan_rows].max(dim=-1).indices
    return tokens


def _suppress(logits: torch.Tensor, suppressed: Sequence[Sequence[int]]) -> torch.Tensor:
    """-inf at each row's suppressed ids, in one indexed write; a no-op if none."""
    rows = [row for row, ids in enumerate(suppressed) for _ in ids]
    if not rows:
        return logits
    cols = [token for ids in suppressed for token in ids]
    logits = logits.clone()
    index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
    logits.index_put_(index, torch.tensor(float("-inf"), device=logits.device, dtype=logits.dtype))
    return logits


def _apply_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    if all(k == vocab for k in ks):
        return logits
    k_tensor = torch.tensor(ks, device=logits.device)
    top_values = logits.topk(max(ks), dim=-1).values
    threshold = top_values.gather(1, (k_tensor - 1).unsqueeze(1))
    return logits.masked_fill(logits < threshold, float("-inf"))


def _apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """-inf for each token less likely than ``min_p`` times its row's most likely one."""
    if not any(p > 0.0 for p in min_p):
        return logits
    m_tensor = torch.tensor(min_p, device=logits.device).unsqueeze(1)
    probs = logits.softmax(dim=-1)
    floor = probs.max(dim=-1, keepdim=True).values * m_tensor
    return logits.masked_fill(probs < floor, float("-inf"))


def _apply_top_p(probs: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Zero every token outside the smallest set, most likely first, holding ``top_p`` of
    the row's mass (``probs`` normalised over what min-p and top-k left)."""
    if not any(p < 1.0 for p in top_p):
        return probs
    p_tensor = torch.tensor(top_p, device=probs.device).unsqueeze(1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # keep a token if the mass strictly before it is below top_p; the most likely
    # always stays, even for a top_p that rounds to 0 in float32 (e.g. 1e-300)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop_sorted = mass_before >= p_tensor
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return probs.masked_fill(drop, 0.0)
