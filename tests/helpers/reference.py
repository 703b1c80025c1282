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
