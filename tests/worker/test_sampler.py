"""Batched sampling: greedy, temperature, top-k/top-p/min-p, per-request seeds."""

from __future__ import annotations

import pytest
import torch

from inflight import LLM, SamplingParams
from inflight.worker.sampler import Sampler

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0]])


def sample_many(params: SamplingParams, draws: int = 4000) -> torch.Tensor:
    sampler = Sampler(torch.device("cpu"))
    logits = LOGITS.repeat(draws, 1)
    ids = [f"r{i}" for i in range(draws)]
    return torch.tensor(sampler.sample(logits, ids, [params] * draws))


def test_greedy_is_argmax():
    assert sample_many(SamplingParams(temperature=0.0), 10).tolist() == [5] * 10


def test_temperature_sampling_follows_softmax():
    tokens = sample_many(SamplingParams(temperature=1.0))
    frequencies = torch.bincount(tokens, minlength=6).float() / len(tokens)
    expected = LOGITS[0].softmax(-1)
    assert torch.allclose(frequencies, expected, atol=0.03), (frequencies, expected)


def test_top_k_keeps_only_k_best():
    tokens = set(sample_many(SamplingParams(temperature=1.0, top_k=2)).tolist())
    assert tokens == {5, 0}


def test_top_p_keeps_smallest_nucleus():
    probs = LOGITS[0].softmax(-1)  # token 5: 0.63, token 0: 0.23, ...
    assert probs[5] < 0.8 < probs[5] + probs[0]
    tokens = set(sample_many(SamplingParams(temperature=1.0, top_p=0.8)).tolist())
    assert tokens == {5, 0}


def test_min_p_drops_unlikely_tokens():
    # min_p=0.3 keeps tokens with p >= 0.3 * p_max: tokens 5 and 0 (0.23/0.63 = 0.37)
    tokens = set(sample_many(SamplingParams(temperature=1.0, min_p=0.3)).tolist())
    assert tokens == {5, 0}


def test_seeded_requests_repeat_and_ignore_batch_neighbours(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), max_num_seqs=8)
    prompt = {"prompt_token_ids": [10, 11, 12, 13]}
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids
    neighbours = [
        {"prompt_token_ids": [20 + i, 30 + i, 40 + i]} for i in range(5)
    ]
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    crowded = llm.generate(
        [*neighbours[:2], prompt, *neighbours[2:]], [unseeded] * 2 + [seeded] + [unseeded] * 3,
        use_tqdm=False,
    )[2].outputs[0].token_ids
    other_seed = llm.generate(
        prompt, SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0].token_ids
    assert alone == crowded
    assert alone != other_seed


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates_text(tiny_llama_dir, include):
    llm = LLM(str(tiny_llama_dir))
    prompt = {"prompt_token_ids": [7, 8, 9]}
    free = llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    words = free.text.split()
    stop = words[5]
    assert stop not in words[:5], "pick a prompt whose 6th word is new"
    out = llm.generate(
        prompt,
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop],
                       include_stop_str_in_output=include),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    prefix = free.text[: free.text.index(stop) + (len(stop) if include else 0)]
    assert out.text == prefix
    assert len(out.token_ids) == 6
