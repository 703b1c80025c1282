"""Greedy reference outputs from Hugging Face transformers' ``generate``."""

from __future__ import annotations

from dataclasses import dataclass

# Two logits closer than this are a near-tie: fp32 summation order may flip the argmax.
NEAR_TIE_LOGIT_GAP = 1e-3


@dataclass
class ReferenceOutput:
    token_ids: list[int]
    # gap between the best and second-best logit at each generated position
    top2_gaps: list[float]


def hf_greedy(model, prompt_token_ids: list[int], max_new_tokens: int) -> ReferenceOutput:
    import torch
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
        output_scores=True, return_dict_in_generate=True,
    )
    # generate() merges the model's own generation config (which names EOS) into ours;
    # clear it so that, like ignore_eos=True, every run makes exactly max_new_tokens.
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        result = model.generate(
            torch.tensor([prompt_token_ids]), generation_config=config,
            attention_mask=torch.ones(1, len(prompt_token_ids), dtype=torch.long),
        )
    tokens = result.sequences[0, len(prompt_token_ids):].tolist()
    gaps = []
    for scores in result.scores:
        top2 = scores[0].float().topk(2).values
        gaps.append(float(top2[0] - top2[1]))
    return ReferenceOutput(tokens, gaps)


def assert_matches_reference(actual: list[int], reference: ReferenceOutput, label: str) -> None:
    """Token-identical, except that a divergence is tolerated at a near-tie (and after it)."""
    expected = reference.token_ids
    for i, (got, want) in enumerate(zip(actual, expected, strict=False)):
        if got != want:
            gap = reference.top2_gaps[i]
            assert gap < NEAR_TIE_LOGIT_GAP, (
                f"{label}: token {i} differs ({got} vs transformers' {want}) and the "
                f"reference's top-2 logit gap there is {gap:.2e}, not a near-tie"
            )
            return
    assert len(actual) == len(expected), f"{label}: {len(actual)} tokens vs {len(expected)}"


@dataclass
class ReferenceBeam:
    tokens: list[int]  # prompt + generated, as vLLM's BeamSearchSequence
    cum_logprob: float
    finished_by_eos: bool


def hf_beam_search(
    model, prompt_token_ids: list[int], beam_width: int, max_tokens: int,
    eos_token_ids: set[int], length_penalty: float = 1.0, ignore_eos: bool = False,
) -> tuple[list[ReferenceBeam], float]:
    """vLLM's beam search (``LLM.beam_search``) written out plainly on a transformers model:
    every step recomputes every live beam from scratch in float64 log-softmax, takes each
    beam's top ``2 * beam_width`` tokens, sends EOS candidates to the finished list and
    keeps the best ``beam_width`` others; the result ranks finished and live beams by
    ``cum_logprob / len(tokens) ** length_penalty`` (a final EOS not counted).

    Returns the best ``beam_width`` beams and the smallest score margin met at any cut
    (a margin below float32 noise makes the comparison with an engine meaningless)."""
    import torch

    def score(beam: ReferenceBeam) -> float:
        length = len(beam.tokens) - (1 if beam.finished_by_eos else 0)
        return beam.cum_logprob / length**length_penalty

    live = [ReferenceBeam(list(prompt_token_ids), 0.0, False)]
    finished: list[ReferenceBeam] = []
    margin = float("inf")
    for _ in range(max_tokens):
        if not live:
            break
        candidates = []
        for beam in live:
            with torch.no_grad():
                logits = model(torch.tensor([beam.tokens])).logits[0, -1].double()
            logprobs = torch.log_softmax(logits, dim=-1)
            top = torch.topk(logprobs, 2 * beam_width)
            for value, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                child = ReferenceBeam(beam.tokens + [token], beam.cum_logprob + value, False)
                if token in eos_token_ids and not ignore_eos:
                    child.finished_by_eos = True
                    finished.append(child)
                else:
                    candidates.append(child)
        candidates.sort(key=lambda b: b.cum_logprob, reverse=True)
        if len(candidates) > beam_width:
            margin = min(margin, candidates[beam_width - 1].cum_logprob
                         - candidates[beam_width].cum_logprob)
        live = candidates[:beam_width]
    ranked = sorted(finished + live, key=score, reverse=True)
    scores = [score(b) for b in ranked]
    margin = min([margin] + [a - b for a, b in zip(scores, scores[1:beam_width + 1], strict=False)])
    return ranked[:beam_width], margin
