"""JSON-schema constraints follow vLLM's default backend (xgrammar, strict mode) and
OpenAI's ``strict``: an object that lists its properties allows no others unless it says
so; tool schemas with ``$defs`` work under ``tool_choice: "required"``; tool-call
arguments keep their characters. Each case was found by a user whose client relied on it.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from inflight import LLM, SamplingParams, StructuredOutputsParams
from inflight.entrypoints.openai.tool_calls import ToolChoice, parse_tools, tool_constraint
from inflight.entrypoints.openai.tool_parsing import constrained_calls, parse_hermes
from inflight.structured_output.grammar import closed_objects, validate_grammar

ANSWER = {"type": "object", "properties": {"answer": {"type": "string",
                                                      "enum": ["Paris", "London"]}},
          "required": ["answer"]}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_num_seqs=4)


def test_listed_properties_close_the_object(llm: LLM) -> None:
    """(The model added "description" and "language" keys to a strict schema's object.)"""
    messages = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    params = SamplingParams(temperature=0, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(json=ANSWER))
    text = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
    assert json.loads(text) == {"answer": "Paris"}


def test_which_objects_are_closed() -> None:
    assert closed_objects(ANSWER)["additionalProperties"] is False
    assert closed_objects({"type": "object"}) == {"type": "object"}  # any object
    assert closed_objects({"type": "object"}, every_object=True)["additionalProperties"] is False
    open_map = {"type": "object", "properties": {}, "additionalProperties": {"type": "integer"}}
    assert closed_objects(open_map) == open_map  # the schema's own word stands
    nested = closed_objects({"anyOf": [ANSWER, {"type": "array", "items": ANSWER}]})
    assert nested["anyOf"][1]["items"]["additionalProperties"] is False


def pydantic_tool() -> dict[str, Any]:
    """What ``openai.pydantic_function_tool`` makes of a model with a nested model."""
    return {"type": "function", "function": {"name": "get_weather", "parameters": {
        "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}},
        "type": "object", "properties": {"location": {"$ref": "#/$defs/Loc"}},
        "required": ["location"]}}}


def test_required_choice_keeps_the_tools_references(llm: LLM) -> None:
    """(``$defs`` moved under ``arguments`` no longer resolved: every required call with a
    pydantic tool was a 400.) Each tool keeps its own references."""
    tools = parse_tools([pydantic_tool(), {"type": "function", "function": {"name": "noop"}}])
    constraint = tool_constraint(tools, ToolChoice("required"), parallel=False)
    validate_grammar(constraint)  # compiles
    prompt = "Call a function for the weather in Paris. Answer in JSON:"
    text = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=80,
                                               structured_outputs=constraint),
                        use_tqdm=False)[0].outputs[0].text
    (call,) = json.loads(text)
    if call["name"] == "get_weather":
        assert set(call["arguments"]) == {"location"}
        assert set(call["arguments"]["location"]) == {"city"}
    else:
        assert call == {"name": "noop", "arguments": {}}  # no parameters: only {}


def test_recursion_and_draft_07_definitions_under_required(llm: LLM) -> None:
    """("#" pointed at the wrapper object, so a linked list's "next" held a whole call;
    draft-07 "definitions" were a 400.) Two tools may also define one name differently."""
    linked = {"type": "function", "function": {"name": "ll", "parameters": {
        "type": "object", "properties": {"v": {"type": "integer"},
                                         "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
        "required": ["v", "next"]}}}
    draft7 = {"type": "function", "function": {"name": "where", "parameters": {
        "definitions": {"Loc": {"type": "string", "enum": ["here", "there"]}},
        "type": "object", "properties": {"loc": {"$ref": "#/definitions/Loc"}},
        "required": ["loc"]}}}
    other = pydantic_tool()
    other["function"]["name"] = "other"
    other["function"]["parameters"]["$defs"]["Loc"] = {"type": "string"}
    for chosen in ([linked], [draft7], [pydantic_tool(), other]):
        validate_grammar(tool_constraint(parse_tools(chosen), ToolChoice("required")))
    constraint = tool_constraint(parse_tools([linked]), ToolChoice("required"))
    out = llm.generate("A linked list of 1, 2, 3 as JSON:", SamplingParams(
        temperature=0, max_tokens=120, structured_outputs=constraint), use_tqdm=False)[0]
    text = out.outputs[0].text  # the model may nest until max_tokens: read its keys
    keys = re.findall(r'"(\w+)"\s*:', text)
    assert keys[:3] == ["name", "arguments", "v"], text
    assert set(keys[3:]) <= {"v", "next"}, text  # every link a node, never a whole call


def test_a_tool_schema_with_its_own_id_under_required(llm: LLM) -> None:
    """(A schema with ``$id`` and local references was a 400 under required only: its
    "#/..." references were rebased, but they resolve against the ``$id`` resource.)"""
    named = {"type": "function", "function": {"name": "ll", "parameters": {
        "$id": "https://example.com/linked-list.json",
        "$defs": {"Value": {"type": "integer"}},
        "type": "object", "properties": {
            "v": {"$ref": "#/$defs/Value"},
            "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
        "required": ["v", "next"]}}}
    constraint = tool_constraint(parse_tools([named]), ToolChoice("required"))
    out = llm.generate("A linked list of 1, 2, 3 as JSON:", SamplingParams(
        temperature=0, max_tokens=120, structured_outputs=constraint), use_tqdm=False)[0]
    text = out.outputs[0].text
    keys = re.findall(r'"(\w+)"\s*:', text)
    assert keys[:3] == ["name", "arguments", "v"], text
    assert set(keys[3:]) <= {"v", "next"}, text  # "#" is the list node, not the call
    values = re.findall(r'"v"\s*:\s*([^,}\s]+)', text)
    assert values and all(re.fullmatch(r"-?\d+", v) for v in values), text  # $defs/Value


def test_keywords_the_grammar_cannot_enforce_do_not_refuse_a_tool(llm: LLM) -> None:
    """(``uniqueItems``, which pydantic writes for every ``set`` field, and ``not`` were 400s
    under a required or named choice only.) The rest of the schema still holds."""
    tagged = {"type": "function", "function": {"name": "tag", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["tags"],
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                "uniqueItems": True, "maxItems": 3},
                       "note": {"not": {"type": "null"}}}}}}
    tools = parse_tools([tagged])
    for choice in (ToolChoice("required"), ToolChoice("named", "tag")):
        constraint = tool_constraint(tools, choice)
        out = llm.generate("Tags for a photo of a cat on a sofa, as JSON:", SamplingParams(
            temperature=0, max_tokens=60, structured_outputs=constraint), use_tqdm=False)[0]
        (call,) = constrained_calls(out.outputs[0].text, choice)
        arguments = json.loads(call.arguments)
        assert set(arguments) <= {"tags", "note"} and "tags" in arguments, arguments
        assert len(arguments["tags"]) <= 3
        assert all(isinstance(t, str) and len(t) <= 12 for t in arguments["tags"]), arguments


def test_arguments_keep_their_characters() -> None:
    tools = parse_tools([{"type": "function", "function": {"name": "f"}}])
    body = '<tool_call>\n{"name": "f", "arguments": {"city": "日本🎉"}}\n</tool_call>'
    _, calls = parse_hermes(body, tools)
    assert calls[0].arguments == '{"city": "日本🎉"}'
    required = constrained_calls('[{"name": "f", "arguments": {"city": "日本"}}]',
                                 ToolChoice("required"))
    assert required[0].arguments == '{"city": "日本"}'


@pytest.mark.parametrize(
    ("constraint", "expected"),
    [
        (StructuredOutputsParams(json={"const": "<|im_end|>"}), '"<|im_end|>"'),
        (StructuredOutputsParams(regex=r"x<\|im_end\|>"), "x<|im_end|>"),
        (StructuredOutputsParams(regex=r"Hi <\|im_start\|>there"), "Hi <|im_start|>there"),
    ],
)
def test_a_special_token_s_text_is_spelled_in_ordinary_tokens(
    llm: LLM, constraint: StructuredOutputsParams, expected: str
) -> None:
    """(The grammar engine forced the special token for its literal text, then refused
    it: the request failed at its first step with a 400.) As xgrammar, vLLM's default,
    the text comes out spelled in ordinary tokens; the special tokens never appear."""
    out = llm.generate("Say:", SamplingParams(temperature=0, max_tokens=20,
                                              structured_outputs=constraint),
                       use_tqdm=False)[0].outputs[0]
    assert out.error is None and out.finish_reason == "stop"
    assert out.text == expected
    special = set(llm.llm_engine.eos_token_ids) | {0, 1, 2}
    # only the final EOS, which the complete grammar forces (as in vLLM)
    assert out.token_ids[-1] in llm.llm_engine.eos_token_ids
    assert not special & set(out.token_ids[:-1])
