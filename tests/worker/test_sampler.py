"""Batched sampling: greedy, temperature, top-k/top-p/min-p, per-request seeds."""

from __future__ import annotations

import json

import pytest
import torch

from inflight import LLM, SamplingParams
from inflight.worker.sampler import Sampler, inverse_transform_sample

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0]])


def sample_many(params: SamplingParams, draws: int = 4000) -> torch.Tensor:
    sampler = Sampler(torch.device("cpu"))
    logits = LOGITS.repeat(draws, 1)
    ids = [f"r{i}" for i in range(draws)]
    return torch.tensor(sampler.sample(logits, ids, [params] * draws).token_ids)


def test_greedy_is_argmax():
    assert sample_many(SamplingParams(temperature=0.0), 10).tolist() == [5] * 10


def test_temperature_sampling_follows_softmax():
    tokens = sample_many(SamplingParams(temperature=1.0))
    frequencies = torch.bincount(tokens, minlength=6).float() / len(tokens)
    expected = LOGITS[0].softmax(-1)
    assert torch.allclose(frequencies, expected, atol=0.03), (frequencies, expected)


def test_inverse_transform_takes_the_first_token_past_the_uniform_mass():
    probs = torch.tensor([[0.2, 0.3, 0.5]], dtype=torch.float64)
    cases = [(0.0, 0), (0.19, 0), (0.2, 1), (0.49, 1), (0.5, 2), (0.999, 2)]
    for u, token in cases:
        assert inverse_transform_sample(probs, torch.tensor([u], dtype=torch.float64)) == token
    # Unnormalised rows with zeroed tokens (top-p, min-p): zeros are never taken, even at
    # the ends of [0, 1), where the target could otherwise land on a flat stretch.
    masked = torch.tensor([[0.0, 2.0, 0.0, 2.0, 0.0]])
    below_one = torch.nextafter(torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0))
    for u, token in [(0.0, 1), (0.49, 1), (0.5, 3), (float(below_one), 3)]:
        assert inverse_transform_sample(masked, torch.tensor([u], dtype=torch.float64)) == token
    # Rows are independent, each with its own number.
    both = torch.cat([probs, probs])
    uniform = torch.tensor([0.1, 0.9], dtype=torch.float64)
    assert inverse_transform_sample(both, uniform).tolist() == [0, 2]


def test_a_tiny_probability_in_a_large_vocabulary_keeps_its_mass():
    # float64 cumulative sums: one token of 1e-9 among 49,152 is drawn for exactly the
    # uniform numbers in its own interval of the cumulative mass.
    probs = torch.full((1, 49152), 1.0)
    probs[0, 30000] = 1e-9
    start = 30000.0 / (49151.0 + 1e-9)
    inside = torch.tensor([start + 1e-15], dtype=torch.float64)
    assert inverse_transform_sample(probs, inside).item() == 30000
    after = torch.tensor([start + 1e-13], dtype=torch.float64)
    assert inverse_transform_sample(probs, after).item() == 30001


def test_top_k_keeps_only_k_best():
    tokens = set(sample_many(SamplingParams(temperature=1.0, top_k=2)).tolist())
    assert tokens == {5, 0}


def test_top_p_keeps_smallest_nucleus():
    probs = LOGITS[0].softmax(-1)  # token 5: 0.63, token 0: 0.23, ...
    assert probs[5] < 0.8 < probs[5] + probs[0]
    tokens = set(sample_many(SamplingParams(temperature=1.0, top_p=0.8)).tolist())
    assert tokens == {5, 0}


@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 1e-8])
def test_a_top_p_near_zero_keeps_the_most_likely_token(top_p):
    # 1e-300 and 1e-45 round to 0 in float32; the nucleus still holds the best token.
    sampler = Sampler(torch.device("cpu"))
    out = sampler.sample(LOGITS.repeat(50, 1), [f"r{i}" for i in range(50)],
                         [SamplingParams(temperature=1.0, top_p=top_p)] * 50)
    assert not out.failed and set(out.token_ids) == {5}


def test_min_p_drops_unlikely_tokens():
    # min_p=0.3 keeps tokens with p >= 0.3 * p_max: tokens 5 and 0 (0.23/0.63 = 0.37)
    tokens = set(sample_many(SamplingParams(temperature=1.0, min_p=0.3)).tolist())
    assert tokens == {5, 0}


def test_top_p_measures_what_min_p_left_as_vllm_orders_them():
    """vLLM applies min-p before top-k/top-p (a user's report: with both set, tokens vLLM
    never samples were drawn 40% of the time). Here p = 0.40, 0.28, 0.27, 0.05: min_p=0.5
    keeps the first three, whose renormalised masses are 0.42, 0.29, 0.28, so top_p=0.41
    keeps only the first; applied to the whole row, it keeps two (0.40 before the second
    is below 0.41)."""
    probs = torch.tensor([0.40, 0.28, 0.27, 0.05])
    logits = probs.log().unsqueeze(0)
    sampler = Sampler(torch.device("cpu"))
    both = SamplingParams(temperature=1.0, min_p=0.5, top_p=0.41)
    out = sampler.sample(logits.repeat(400, 1), [f"r{i}" for i in range(400)], [both] * 400)
    assert set(out.token_ids) == {0}
    # Each alone keeps what it should: top_p=0.41 two tokens, min_p=0.5 three.
    alone = sampler.sample(logits.repeat(2000, 1), [f"t{i}" for i in range(2000)],
                           [SamplingParams(temperature=1.0, top_p=0.41)] * 2000)
    assert set(alone.token_ids) == {0, 1}
    alone = sampler.sample(logits.repeat(2000, 1), [f"m{i}" for i in range(2000)],
                           [SamplingParams(temperature=1.0, min_p=0.5)] * 2000)
    assert set(alone.token_ids) == {0, 1, 2}


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


# ---------------------------------------------------------------- min_tokens, failures


def test_suppressed_ids_are_never_sampled_and_other_rows_are_untouched():
    sampler = Sampler(torch.device("cpu"))
    logits = LOGITS.repeat(3, 1)
    greedy = SamplingParams(temperature=0.0)
    # Row 0 may not end (5 and 0 are its stop ids); rows 1 and 2 have nothing suppressed.
    out = sampler.sample(logits, ["a", "b", "c"], [greedy] * 3, [(5, 0), (), ()])
    assert out.token_ids == [1, 5, 5] and not out.failed
    assert torch.equal(logits, LOGITS.repeat(3, 1))  # the caller's logits are not changed
    random = SamplingParams(temperature=1.0)
    drawn = sampler.sample(LOGITS.repeat(2000, 1), [f"r{i}" for i in range(2000)],
                           [random] * 2000, [(5, 0)] * 2000).token_ids
    assert not {5, 0} & set(drawn)


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63), -2, 0])
def test_any_accepted_seed_makes_a_generator_that_repeats(seed):
    params = SamplingParams(temperature=1.0, seed=seed)
    draws = [Sampler(torch.device("cpu")).sample(LOGITS.repeat(1, 1), ["a"], [params])
             for _ in range(2)]
    assert draws[0] == draws[1] and not draws[0].failed


def test_a_row_whose_generator_cannot_be_made_fails_alone(monkeypatch):
    sampler = Sampler(torch.device("cpu"))
    original = Sampler._generator

    def broken(self, request_id, seed):
        if request_id == "bad":
            raise OverflowError("injected")
        return original(self, request_id, seed)

    monkeypatch.setattr(Sampler, "_generator", broken)
    seeded = SamplingParams(temperature=1.0, seed=7)
    ids = ["good", "bad", "greedy"]
    params = [seeded, seeded, SamplingParams(temperature=0.0)]
    out = sampler.sample(LOGITS.repeat(3, 1), ids, params)
    assert set(out.failed) == {"bad"} and "injected" in out.failed["bad"]
    alone = Sampler(torch.device("cpu")).sample(LOGITS, ["good"], [seeded])
    assert out.token_ids[0] == alone.token_ids[0] and out.token_ids[2] == 5


def test_non_finite_logits_sample_in_range_as_softmax_s_limit():
    """An extreme repetition penalty can overflow float32 (a repetition_penalty of
    5e-324 is 0.0 as float32: a positive logit / 0 is +inf, 0 / 0 NaN). Such rows must
    still give in-range tokens: +inf tokens share the mass equally, NaN counts as -inf, a
    row with nothing left fails alone; finite rows are untouched."""
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor([
        [1.0, inf, 0.0, inf, nan, -inf],     # +inf at 1 and 3: one of them, evenly
        [nan, 2.0, nan, -inf, 2.0, -inf],    # NaN as -inf: 1 or 4, evenly
        [nan, -inf, nan, -inf, -inf, -inf],  # nothing samplable: fails alone
    ])
    draws = 2000
    sampler = Sampler(torch.device("cpu"))
    params = SamplingParams(temperature=1.0)
    rows = torch.cat([logits, LOGITS]).repeat(draws, 1)
    ids = [f"r{i}" for i in range(len(rows))]
    out = sampler.sample(rows, ids, [params] * len(rows))
    tokens = torch.tensor(out.token_ids).view(draws, 4)
    assert int(tokens.max()) < 6 and int(tokens.min()) >= 0
    for row, allowed in ((0, {1, 3}), (1, {1, 4})):
        counts = torch.bincount(tokens[:, row], minlength=6)
        assert set(counts.nonzero().flatten().tolist()) == allowed
        assert abs(int(counts[min(allowed)]) - draws / 2) < draws * 0.06
    assert set(out.failed) == {f"r{4 * i + 2}" for i in range(draws)}
    assert "-inf or NaN" in out.failed["r2"]
    finite = torch.bincount(tokens[:, 3], minlength=6).float() / draws
    assert torch.allclose(finite, LOGITS[0].softmax(-1), atol=0.04)


def test_a_vanishing_repetition_penalty_does_not_stop_the_engine(tiny_llama_dir):
    """The fuzzed request that crashed a step (index past the vocabulary): prompt [0],
    repetition_penalty 5e-324, random sampling; it completes, and so does its neighbour."""
    llm = LLM(str(tiny_llama_dir), max_model_len=64)
    vocab = json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    outs = llm.generate(
        [{"prompt_token_ids": [0]}, {"prompt_token_ids": [5, 6, 7]}],
        [SamplingParams(repetition_penalty=5e-324, max_tokens=20, ignore_eos=True, seed=1),
         SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)],
    )
    assert len(outs[0].outputs[0].token_ids) == 20 and len(outs[1].outputs[0].token_ids) == 8
    assert max(outs[0].outputs[0].token_ids) < vocab


def test_greedy_rows_with_every_logit_minus_inf_fail_alone():
    """A greedy row with nothing left (every logit -inf) fails alone (it used to emit id
    0); a +inf row takes its first +inf, other rows their argmax."""
    inf = float("inf")
    logits = torch.tensor([[0.5, inf, 2.0, inf], [-inf, -inf, -inf, -inf], [1.0, 3.0, 0.0, 2.0]])
    greedy = SamplingParams(temperature=0.0)
    out = Sampler(torch.device("cpu")).sample(logits, ["inf", "empty", "plain"], [greedy] * 3)
    assert out.token_ids[0] == 1 and out.token_ids[2] == 1
    assert set(out.failed) == {"empty"}
    from inflight.sampling_params import NO_TOKEN_LEFT

    assert out.failed["empty"].startswith(NO_TOKEN_LEFT)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_request_with_no_token_left_fails_alone(tiny_llama_dir, temperature):
    """allowed_token_ids whose only id is a bad word: nothing can be sampled, greedy or
    random; that request ends with finish_reason "error" and its neighbour is unchanged."""
    llm = LLM(str(tiny_llama_dir), max_model_len=64)
    normal = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": [5, 6, 7]}], normal)[0].outputs[0].token_ids
    word = llm.get_tokenizer().decode([40])
    blocked = SamplingParams(temperature=temperature, max_tokens=6, allowed_token_ids=[40],
                             bad_words=[word], seed=0)
    outs = llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [5, 6, 7]}],
                        [blocked, normal])
    assert outs[0].outputs[0].finish_reason == "error"
    assert outs[1].outputs[0].token_ids == alone


def test_the_server_answers_no_token_left_with_a_400():
    from inflight.engine.request_stream import RequestFailedError
    from inflight.entrypoints.openai.serving import engine_failure
    from inflight.sampling_params import NO_TOKEN_LEFT

    client = engine_failure(RequestFailedError(f"the request failed: {NO_TOKEN_LEFT}: ..."))
    assert client.status == 400 and client.type == "invalid_request_error"
    ours = engine_failure(RequestFailedError("the request failed: could not prepare the sampler"))
    assert ours.status == 500
