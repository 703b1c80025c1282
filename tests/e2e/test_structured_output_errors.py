"""Bad structured-output constraints are rejected when the request is made; a grammar
that cannot be compiled fails its request alone. Tiny random model: no real text needed."""

from __future__ import annotations

import pytest

from inflight import LLM, SamplingParams, StructuredOutputsParams
from inflight.sampling_params import InvalidRequestError

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [100, 200, 300]]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), max_model_len=128, max_num_seqs=4)


@pytest.fixture(scope="module")
def alone(llm):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("fields, message", [
    (dict(), "exactly one of"),
    (dict(regex="a", choice=["a"]), "exactly one of"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(json=[1, 2]), "JSON schema object"),
    (dict(choice=[]), "choice"),
    (dict(choice=["a", 3]), "choice"),
    (dict(grammar=""), "grammar"),
    (dict(json_object="yes"), "json_object"),
])
def test_malformed_params_raise_naming_the_field(fields, message) -> None:
    with pytest.raises(InvalidRequestError, match=message) as error:
        StructuredOutputsParams(**fields)
    assert error.value.parameter == "structured_outputs"


def test_unknown_field_from_a_dict_is_rejected() -> None:
    with pytest.raises(InvalidRequestError, match="unknown field"):
        SamplingParams(structured_outputs={"json_schema": {}})
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs.regex == "a+"


@pytest.mark.parametrize("constraint, message", [
    (dict(json={"type": "strin"}), "Invalid type"),
    (dict(json={"type": "object", "properties": 5}), "properties"),
    (dict(regex="(ab"), "regex"),
    (dict(grammar="start: foo\nfoo: bar"), "grammar"),
])
def test_a_constraint_that_cannot_compile_is_rejected_while_others_run(
    llm, alone, constraint, message
) -> None:
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"good-{message}-{i}", {"prompt_token_ids": prompt}, GREEDY)
    engine.step()
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(InvalidRequestError, match=message) as error:
        engine.add_request("bad", {"prompt_token_ids": [5, 6]}, params)
    assert error.value.parameter == "structured_outputs"
    assert "bad" not in engine.scheduler.requests
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert [done[f"good-{message}-{i}"] for i in range(len(PROMPTS))] == alone


def test_a_grammar_that_fails_to_compile_fails_only_its_request(llm, alone) -> None:
    # The tiny model's word-level tokenizer is one llguidance cannot use, so the compile
    # (on the background thread) fails after the request was accepted.
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="w5+"))
    outs = llm.generate(
        [{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": [9, 9]}, {"prompt_token_ids": PROMPTS[1]}],
        [GREEDY, params, GREEDY], use_tqdm=False,
    )
    failed = outs[1].outputs[0]
    assert failed.finish_reason == "error" and "structured outputs" in failed.error
    assert failed.token_ids == []
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == alone
    assert llm.llm_engine.structured_output.num_requests == 0
    assert not llm.llm_engine.has_unfinished_requests()
