"""Structured outputs on the default model: every output matches its constraint, and a
constrained request's greedy tokens do not depend on its batch or on preemption.

One batched ``generate`` call carries 20 JSON schemas (greedy and sampled), regexes,
choices, ``json_object`` and unconstrained requests; the other tests compare against it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import jsonschema
import pytest
from structured_schemas import NO_WHITESPACE, SCHEMAS

from inflight import LLM, SamplingParams, StructuredOutputsParams
from inflight.entrypoints.chat_utils import ChatOptions, render_chat

REGEXES = {
    "phone": r"[0-9]{3}-[0-9]{4}",
    "word": r"[a-z]{2,8}",
    "version": r"v[0-9]\.[0-9]{1,2}",
}
CHOICES = {
    "capital": (["Paris", "London", "Berlin"], "What is the capital of France?"),
    "sentiment": (["positive", "negative", "neutral"], "Sentiment of: I love this!"),
}
# The dense weights for every step: steps of one and of many sequences then use the same
# arithmetic, so greedy tokens alone and in a batch can be compared exactly.
ENGINE = dict(quantization="none", dtype="float32")


@dataclass(frozen=True)
class Case:
    label: str
    question: str
    params: SamplingParams


def _cases() -> list[Case]:
    cases = []
    for name, schema in SCHEMAS.items():
        so = StructuredOutputsParams(json=schema, disable_any_whitespace=name in NO_WHITESPACE)
        question = f"Reply with JSON for this schema: {json.dumps(schema)}"
        cases.append(Case(f"json-{name}-greedy", question,
                          SamplingParams(temperature=0.0, max_tokens=96, structured_outputs=so)))
        cases.append(Case(f"json-{name}-sampled", question, SamplingParams(
            temperature=0.8, top_p=0.95, seed=1234, max_tokens=96, structured_outputs=so)))
    for name, regex in REGEXES.items():
        so = StructuredOutputsParams(regex=regex)
        cases.append(Case(f"regex-{name}", f"Give me a {name}.",
                          SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=so)))
    for name, (choice, question) in CHOICES.items():
        so = StructuredOutputsParams(choice=choice)
        cases.append(Case(f"choice-{name}", question,
                          SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=so)))
        cases.append(Case(f"choice-{name}-sampled", question, SamplingParams(
            temperature=1.0, seed=7, max_tokens=24, structured_outputs=so)))
    so = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    cases.append(Case("json-object", 'Return a JSON object with the key "ok" set to true.',
                      SamplingParams(temperature=0.0, max_tokens=96, structured_outputs=so)))
    for i, question in enumerate(["Hi!", "Name a fruit."]):
        cases.append(Case(f"plain-{i}", question, SamplingParams(temperature=0.0, max_tokens=12)))
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_num_seqs=64, **ENGINE)


def _prompt(llm: LLM, question: str) -> dict[str, list[int]]:
    rendered = render_chat(
        llm.get_tokenizer(), [{"role": "user", "content": question}], ChatOptions()
    )
    return {"prompt_token_ids": rendered.prompt_token_ids}


@pytest.fixture(scope="module")
def batch(llm: LLM) -> dict[str, list[int] | str | None]:
    outs = llm.generate([_prompt(llm, c.question) for c in CASES], [c.params for c in CASES],
                        use_tqdm=False)
    assert llm.llm_engine.structured_output.num_requests == 0, "matchers must be freed"
    return {c.label: o.outputs[0] for c, o in zip(CASES, outs, strict=True)}  # type: ignore[misc]


def test_twenty_json_schemas_greedy_and_sampled_validate(batch) -> None:
    assert len(SCHEMAS) == 20
    for name, schema in SCHEMAS.items():
        for mode in ("greedy", "sampled"):
            out = batch[f"json-{name}-{mode}"]
            if mode == "sampled" and out.finish_reason == "length":
                # JSON numbers may have any number of digits, and a sampled answer can
                # run on in one until max_tokens; cut anywhere else, it is a fault.
                assert re.search(r"[0-9]\.?[0-9]*$", out.text), f"{name} {mode}: {out.text!r}"
                continue
            assert out.finish_reason == "stop", f"{name} {mode}: {out.text!r}"
            jsonschema.validate(json.loads(out.text), schema)


def test_regex_outputs_fullmatch(batch) -> None:
    for name, regex in REGEXES.items():
        out = batch[f"regex-{name}"]
        assert re.fullmatch(regex, out.text), f"{name}: {out.text!r}"
        assert out.finish_reason == "stop" or len(out.token_ids) == 24


def test_choice_outputs_are_one_of_the_choices(batch) -> None:
    for name, (choice, _) in CHOICES.items():
        for suffix in ("", "-sampled"):
            out = batch[f"choice-{name}{suffix}"]
            assert out.text in choice and out.finish_reason == "stop", out.text


def test_a_complete_answer_ends_with_the_eos_it_forces(llm, batch) -> None:
    """As vLLM: once the grammar is complete only EOS may follow, and the engine samples
    it, so a choice's tokens are its text's plus EOS (vLLM 0.32 on the same checkpoint:
    "yes" -> [10407, 2]); the EOS's text stays out of the answer."""
    eos = set(llm.llm_engine.eos_token_ids)
    tokenizer = llm.get_tokenizer()
    for name in CHOICES:
        for suffix in ("", "-sampled"):
            out = batch[f"choice-{name}{suffix}"]
            assert out.finish_reason == "stop" and out.stop_reason is None
            assert out.token_ids[-1] in eos, out.token_ids
            assert tokenizer.decode(out.token_ids[:-1]) == out.text


def test_json_object_output_parses(batch) -> None:
    out = batch["json-object"]
    assert out.finish_reason == "stop"
    assert isinstance(json.loads(out.text), dict)


def test_unconstrained_requests_in_a_constrained_batch_are_unchanged(llm, batch) -> None:
    plain = [c for c in CASES if c.params.structured_outputs is None]
    alone = [llm.generate(_prompt(llm, c.question), c.params, use_tqdm=False)[0] for c in plain]
    assert [batch[c.label].token_ids for c in plain] == [o.outputs[0].token_ids for o in alone]


ALONE = ["json-nested-greedy", "json-defs-ref-greedy", "regex-phone", "choice-sentiment"]


def test_constrained_greedy_output_is_the_same_alone_as_in_the_mixed_batch(llm, batch) -> None:
    for label in ALONE:
        case = next(c for c in CASES if c.label == label)
        alone = llm.generate(_prompt(llm, case.question), case.params, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == batch[label].token_ids, label
        assert alone.outputs[0].text == batch[label].text


def test_constrained_greedy_output_survives_preemption(batch) -> None:
    small = LLM(max_num_seqs=4, num_kv_blocks=40, block_size=8, record_trace=True, **ENGINE)
    cases = [next(c for c in CASES if c.label == label) for label in [*ALONE, "plain-1"]]
    outs = small.generate([_prompt(small, c.question) for c in cases], [c.params for c in cases],
                          use_tqdm=False)
    assert any(r.preempted for r in small.step_trace.records), "the tiny cache must preempt"
    for case, out in zip(cases, outs, strict=True):
        assert out.outputs[0].token_ids == batch[case.label].token_ids, case.label
    assert small.llm_engine.structured_output.num_requests == 0
