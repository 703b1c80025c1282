"""Every sampling option end to end on the tiny model: logprobs and prompt logprobs against
transformers, n > 1 sharing the prompt, penalties against transformers' greedy, logit bias,
seeded reproducibility, and clear errors for bad values."""

from __future__ import annotations

import random

import pytest
import torch

from helpers.tiny_model import VOCAB_SIZE
from inflight import LLM, SamplingParams

BLOCK = 4
PROMPT = [random.Random(7).randrange(3, VOCAB_SIZE) for _ in range(11)]


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", block_size=BLOCK, record_trace=True)


def generate(llm: LLM, params: SamplingParams, prompt=PROMPT):
    return llm.generate([{"prompt_token_ids": list(prompt)}], params, use_tqdm=False)[0]


def hf_log_softmax(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def greedy(**extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, **{"max_tokens": 8, **extra})


# ---------------------------------------------------------------- logprobs


def test_greedy_logprobs_match_transformers(llm, hf_model):
    out = generate(llm, greedy(logprobs=3)).outputs[0]
    reference = hf_log_softmax(hf_model, PROMPT + out.token_ids)
    assert len(out.logprobs) == len(out.token_ids)
    total = 0.0
    for step, (token, position) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = reference[len(PROMPT) - 1 + step]
        assert abs(position[token].logprob - float(row[token])) < 1e-4
        assert position[token].rank == 1  # greedy picks the most likely token
        top = list(position.items())
        assert len(top) == 3 and top[0][0] == token  # sampled token ranks inside k=3
        values = [lp.logprob for _, lp in top]
        assert values == sorted(values, reverse=True)
        assert [lp.rank for _, lp in top] == [1, 2, 3]
        assert [t for t, _ in top] == row.topk(3).indices.tolist()
        total += position[token].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_sampled_token_outside_top_k_is_listed_with_its_rank(llm):
    params = SamplingParams(temperature=5.0, seed=3, max_tokens=12, ignore_eos=True, logprobs=1)
    out = generate(llm, params).outputs[0]
    for token, position in zip(out.token_ids, out.logprobs, strict=True):
        assert token in position
        assert (len(position) == 1) == (position[token].rank == 1)
    assert any(p[t].rank > 1 for t, p in zip(out.token_ids, out.logprobs, strict=True))


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 3}])
def test_prompt_logprobs_match_transformers(tiny_llama_dir, hf_model, options):
    # max_num_batched_tokens=3: the prompt is computed in chunks of 3.
    engine = LLM(str(tiny_llama_dir), dtype="float32", block_size=BLOCK, **options)
    params = greedy(max_tokens=2, prompt_logprobs=2)
    generate(engine, greedy(max_tokens=1))  # the prompt's blocks are now cached
    out = generate(engine, params)
    assert out.num_cached_tokens == 0  # prompt logprobs skip the prefix cache
    reference = hf_log_softmax(hf_model, PROMPT)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    for position in range(1, len(PROMPT)):
        entry = out.prompt_logprobs[position]
        token = PROMPT[position]
        assert abs(entry[token].logprob - float(reference[position - 1, token])) < 1e-4
        assert 2 <= len(entry) <= 3


def test_max_tokens_zero_returns_only_prompt_logprobs(llm, hf_model):
    out = generate(llm, SamplingParams(max_tokens=0, prompt_logprobs=0))
    completion = out.outputs[0]
    assert out.finished and completion.token_ids == [] and completion.text == ""
    assert completion.finish_reason == "length"
    reference = hf_log_softmax(hf_model, PROMPT)
    got = [out.prompt_logprobs[p][PROMPT[p]].logprob for p in range(1, len(PROMPT))]
    want = [float(reference[p - 1, PROMPT[p]]) for p in range(1, len(PROMPT))]
    assert got == pytest.approx(want, abs=1e-4)
    assert not llm.llm_engine.has_unfinished_requests()


# ---------------------------------------------------------------- n > 1


def test_n4_computes_the_prompt_once(llm):
    llm.reset_prefix_cache()
    llm.step_trace.clear()
    out = generate(llm, SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True))
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    prefill = [e for r in llm.step_trace.records for e in r.entries if e.kind == "prefill"]
    full = (len(PROMPT) - 1) // BLOCK * BLOCK
    # Child 0 computes the whole prompt; the others only the part after its full blocks.
    assert sorted(e.num_tokens for e in prefill) == [len(PROMPT) - full] * 3 + [len(PROMPT)]
    assert sorted(e.num_cached_tokens for e in prefill) == [0] + [full] * 3
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in out.outputs)
    # Seeded: reproducible, distinct, and completion i is the stream of seed + i.
    again = generate(llm, SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True))
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4
    alone = generate(llm, SamplingParams(temperature=1.0, seed=13, max_tokens=6, ignore_eos=True))
    assert alone.outputs[0].token_ids == out.outputs[2].token_ids


def test_n_greedy_completions_are_identical(llm):
    out = generate(llm, greedy(n=3, logprobs=1))
    single = generate(llm, greedy())
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for completion in out.outputs:
        assert completion.token_ids == single.outputs[0].token_ids
        assert completion.cumulative_logprob == pytest.approx(out.outputs[0].cumulative_logprob)


def test_n_without_prefix_caching_still_works(tiny_llama_dir):
    engine = LLM(str(tiny_llama_dir), dtype="float32", enable_prefix_caching=False)
    out = generate(engine, greedy(n=2))
    assert len(out.outputs) == 2 and out.outputs[0].token_ids == out.outputs[1].token_ids


def test_abort_of_the_parent_aborts_every_child(llm):
    engine = llm.llm_engine
    engine.add_request("parent", {"prompt_token_ids": PROMPT}, greedy(n=3, max_tokens=50))
    engine.step()
    engine.abort_request("parent")
    assert not engine.has_unfinished_requests()
    engine.scheduler.check_invariants()
    assert engine.kv_cache.pool.num_used_blocks == 0


# ---------------------------------------------------------------- penalties and biases


def test_greedy_repetition_penalty_matches_transformers(llm, hf_model):
    out = generate(llm, greedy(max_tokens=12, repetition_penalty=1.8)).outputs[0]
    with torch.no_grad():
        result = hf_model.generate(
            torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False,
            repetition_penalty=1.8, pad_token_id=0,
            attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
        )
    assert out.token_ids == result[0, len(PROMPT):].tolist()
    assert out.token_ids != generate(llm, greedy(max_tokens=12)).outputs[0].token_ids


def test_logit_bias_bans_and_forces_tokens(llm):
    plain = generate(llm, greedy()).outputs[0].token_ids
    banned = plain[0]
    out = generate(llm, greedy(logit_bias={banned: -100})).outputs[0].token_ids
    assert banned not in out
    forced = generate(llm, greedy(logit_bias={42: 100})).outputs[0].token_ids
    assert forced == [42] * 8
    allowed = generate(llm, SamplingParams(seed=1, max_tokens=20, allowed_token_ids=[5, 6]))
    assert set(allowed.outputs[0].token_ids) <= {5, 6}


def test_bad_words_are_never_generated(llm):
    tokenizer = llm.get_tokenizer()
    plain = generate(llm, greedy()).outputs[0].token_ids
    word = tokenizer.decode([plain[0]])
    out = generate(llm, greedy(bad_words=[word])).outputs[0].token_ids
    assert plain[0] not in out


def test_seeded_penalised_sampling_is_reproducible_in_any_batch(tiny_llama_dir):
    params = SamplingParams(
        temperature=1.0, seed=5, max_tokens=20, ignore_eos=True, presence_penalty=1.5,
        frequency_penalty=0.5, repetition_penalty=1.2, logit_bias={9: 3.0},
    )
    others = [
        SamplingParams(temperature=0.8, max_tokens=15, ignore_eos=True, frequency_penalty=1.0),
        SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True),
    ]
    prompts = [{"prompt_token_ids": p} for p in (PROMPT, PROMPT[:5], list(range(3, 40)))]
    alone = generate(LLM(str(tiny_llama_dir), dtype="float32"), params).outputs[0].token_ids
    for options in ({"max_num_seqs": 8}, {"num_kv_blocks": 20, "block_size": 4}):
        engine = LLM(str(tiny_llama_dir), dtype="float32", **options)
        outs = engine.generate(prompts, [params, *others], use_tqdm=False)
        assert outs[0].outputs[0].token_ids == alone, options
        if "num_kv_blocks" in options:
            assert engine.llm_engine.scheduler.num_preemptions > 0


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "params, message",
    [
        (dict(logprobs=21), "logprobs of 21, which is greater than max allowed: 20"),
        (dict(prompt_logprobs=30), "prompt_logprobs"),
        (dict(logit_bias={VOCAB_SIZE: 1.0}), "out-of-vocab"),
        (dict(allowed_token_ids=[VOCAB_SIZE + 3]), "allowed_token_ids"),
    ],
)
def test_bad_values_are_refused_when_added(llm, params, message):
    with pytest.raises(ValueError, match=message):
        generate(llm, SamplingParams(**params))
    assert not llm.llm_engine.has_unfinished_requests()


def test_max_logprobs_is_an_engine_option(tiny_llama_dir):
    engine = LLM(str(tiny_llama_dir), dtype="float32", max_logprobs=2)
    with pytest.raises(ValueError, match="max allowed: 2"):
        generate(engine, greedy(logprobs=3))
    assert len(generate(engine, greedy(logprobs=2)).outputs[0].logprobs[0]) == 2


def test_detokenize_false_leaves_logprob_texts_empty(llm):
    """vLLM: without detokenize there is no text anywhere, logprobs' decoded_token too."""
    plain = generate(llm, greedy(logprobs=2, prompt_logprobs=1))
    quiet = generate(llm, greedy(logprobs=2, prompt_logprobs=1, detokenize=False))
    assert quiet.outputs[0].token_ids == plain.outputs[0].token_ids
    assert quiet.outputs[0].text == "" and plain.outputs[0].text
    for positions, expect_text in ((quiet.outputs[0].logprobs, False),
                                   (plain.outputs[0].logprobs, True),
                                   (quiet.prompt_logprobs[1:], False)):
        texts = [lp.decoded_token for pos in positions for lp in pos.values()]
        assert texts and all((t is not None) == expect_text for t in texts)
