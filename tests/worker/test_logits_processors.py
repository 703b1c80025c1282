"""Penalties, logit bias, allowed tokens and bad words on fixed logits, against hand-computed
expectations (vLLM's / OpenAI's definitions), batched and one row at a time."""

from __future__ import annotations

import dataclasses

import torch

from inflight.sampling_params import SamplingParams
from inflight.worker.logits_processors import LogitsProcessors, ProcessorRow
from inflight.worker.logprobs import token_logprobs

NEG_INF = float("-inf")
LOGITS = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]])
VOCAB = LOGITS.shape[1]


def processors() -> LogitsProcessors:
    return LogitsProcessors(VOCAB, torch.device("cpu"))


def run(params: SamplingParams, prompt=(), generated=(), request_id="r") -> torch.Tensor:
    """Apply the processors after ``generated`` tokens were recorded one step at a time."""
    procs = processors()
    row = ProcessorRow(request_id, params, tuple(prompt))
    procs.apply(LOGITS, [row])  # first step: creates the state
    for token in generated:
        procs.record([row], [token])
    return procs.apply(LOGITS, [row])[0]


def test_penalties_match_hand_computed_values():
    # prompt [1], generated [3, 3, 2]: token 3 seen twice, token 2 once, token 1 in the prompt.
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = run(params, prompt=[1], generated=[3, 3, 2])
    # repetition (seen: 1, 2, 3): -1 -> -2, 0.5 -> 0.25, 3 -> 1.5; token 0 and 4 unseen.
    # frequency: token 3 -= 0.5*2, token 2 -= 0.5*1; presence: tokens 2 and 3 -= 0.25.
    expected = torch.tensor([2.0, -2.0, 0.25 - 0.5 - 0.25, 1.5 - 1.0 - 0.25, 0.0])
    torch.testing.assert_close(out, expected)


def test_frequency_and_presence_ignore_the_prompt():
    out = run(SamplingParams(frequency_penalty=1.0, presence_penalty=1.0), prompt=[0, 3])
    torch.testing.assert_close(out, LOGITS[0])


def test_logit_bias_adds_to_each_listed_token():
    out = run(SamplingParams(logit_bias={0: -100.0, 4: 10.0}))
    torch.testing.assert_close(out, torch.tensor([-98.0, -1.0, 0.5, 3.0, 10.0]))


def test_allowed_token_ids_mask_every_other_token():
    out = run(SamplingParams(allowed_token_ids=[1, 4]))
    torch.testing.assert_close(out, torch.tensor([NEG_INF, -1.0, NEG_INF, NEG_INF, 0.0]))


def test_bad_words_one_token_always_longer_after_their_prefix():
    params = SamplingParams()
    params._bad_words_token_ids = ((2,), (3, 4))
    assert run(params).tolist() == [2.0, -1.0, NEG_INF, 3.0, 0.0]
    # After 3 was generated, the word (3, 4) is one token away: 4 is banned too.
    assert run(params, generated=[1, 3]).tolist() == [2.0, -1.0, NEG_INF, 3.0, NEG_INF]
    assert run(params, generated=[3, 1]).tolist() == [2.0, -1.0, NEG_INF, 3.0, 0.0]


def test_batched_rows_equal_the_same_rows_one_at_a_time():
    settings = [
        SamplingParams(),
        SamplingParams(repetition_penalty=1.5, presence_penalty=0.5),
        SamplingParams(logit_bias={2: 5.0}),
        SamplingParams(frequency_penalty=-1.0, allowed_token_ids=[0, 2, 3]),
        SamplingParams(temperature=0.0),
    ]
    generated = [[3], [0, 0], [2], [3, 2, 3], [1]]
    logits = torch.randn(len(settings), VOCAB, generator=torch.Generator().manual_seed(0))
    batched = processors()
    rows = [ProcessorRow(f"r{i}", p, (1, 4)) for i, p in enumerate(settings)]
    batched.apply(logits, rows)
    for step in range(3):
        batched.record(rows, [g[step] if step < len(g) else None for g in generated])
    together = batched.apply(logits, rows)
    for i, row in enumerate(rows):
        alone = processors()
        alone.apply(logits[i : i + 1], [row])
        for token in generated[i]:
            alone.record([row], [token])
        torch.testing.assert_close(together[i], alone.apply(logits[i : i + 1], [row])[0])
    assert torch.equal(together[0], logits[0]) and torch.equal(together[4], logits[4])


def test_rows_without_options_pay_nothing():
    logits = LOGITS.repeat(3, 1)
    rows = [ProcessorRow(f"r{i}", SamplingParams()) for i in range(3)]
    assert processors().apply(logits, rows) is logits


def test_state_is_dropped_when_forgotten():
    procs = processors()
    row = ProcessorRow("r", SamplingParams(presence_penalty=1.0))
    procs.apply(LOGITS, [row])
    procs.record([row], [3])
    assert procs.apply(LOGITS, [row])[0, 3] == 2.0
    procs.forget(["r"])
    assert procs.apply(LOGITS, [dataclasses.replace(row)])[0, 3] == 3.0


def test_token_logprobs_rank_and_sorted_top_k():
    entries = token_logprobs(LOGITS.repeat(2, 1), [3, 1], [2, 0])
    reference = torch.log_softmax(LOGITS[0], dim=-1)
    assert entries[0].rank == 1 and entries[1].rank == 5
    assert abs(entries[1].logprob - float(reference[1])) < 1e-6
    assert entries[0].top_token_ids == (3, 0) and entries[1].top_token_ids == ()
    assert list(entries[0].top_logprobs) == sorted(entries[0].top_logprobs, reverse=True)
