"""Tool calling on chat completions: ``tools`` and ``tool_choice``.

Required and named choices run on the default model (served once for the module; the
grammar needs a tokenizer llguidance reads): their arguments must validate against the
tool's parameter schema (``jsonschema``), and streamed tool-call deltas must reassemble to
the non-streamed call. The Hermes parser, the streamer and the default tool rendering are
checked on fixed texts; malformed tools and choices are 400s on the shared tiny server.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from server_harness import API_KEY, ServerProcess

from inflight import SamplingParams
from inflight.entrypoints.openai.errors import OpenAIError
from inflight.entrypoints.openai.tool_calls import (
    ToolChoice,
    parse_tools,
    render_tool_messages,
    tool_answer_params,
    tool_constraint,
)
from inflight.entrypoints.openai.tool_parsing import ToolCallStreamer, parse_answer

MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 16}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME},
    },
]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(start_server: Callable[..., ServerProcess]) -> openai.OpenAI:
    server = start_server("--max-num-seqs", "4")
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _create(client: openai.OpenAI, **fields: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, tools=TOOLS, max_tokens=60, temperature=0, **fields
    )


def _reassemble(stream: Any) -> tuple[list[dict[str, str]], str | None]:
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                call["name"] += delta.function.name or "" if delta.function else ""
                call["arguments"] += delta.function.arguments or "" if delta.function else ""
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"],
)
def test_constrained_tool_calls_validate_and_stream_the_same(
    client: openai.OpenAI, tool_choice: Any
) -> None:
    # OpenAI's finish reasons: tool_calls for required, stop for a named function.
    want_finish = "stop" if isinstance(tool_choice, dict) else "tool_calls"
    response = _create(client, messages=MESSAGES, tool_choice=tool_choice)
    choice = response.choices[0]
    assert choice.finish_reason == want_finish, choice
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and (len(calls) == 1 or tool_choice == "required")  # required: 1 or more
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        if isinstance(tool_choice, dict):
            assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    streamed, finish = _reassemble(
        _create(client, messages=MESSAGES, tool_choice=tool_choice, stream=True)
    )
    assert finish == want_finish
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (call.function.name, call.function.arguments) for call in calls
    ]
    assert all(c["id"].startswith("call_") for c in streamed)


@pytest.mark.parametrize(
    ("tool_choice", "max_tokens"),
    [("required", 20), ({"type": "function", "function": {"name": "get_weather"}}, 8)],
    ids=["required", "named"],
)
def test_a_call_cut_by_max_tokens_is_still_a_call_streamed_or_not(
    client: openai.OpenAI, tool_choice: Any, max_tokens: int
) -> None:
    # Cut inside the arguments: OpenAI answers finish_reason "length" with the call and its
    # arguments so far; the stream must carry the same call.
    fields: dict[str, Any] = dict(
        model=MODEL, tools=TOOLS, temperature=0, messages=MESSAGES, tool_choice=tool_choice,
        max_tokens=max_tokens,
    )
    choice = client.chat.completions.create(**fields).choices[0]
    assert choice.finish_reason == "length", choice
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    with pytest.raises(ValueError):  # cut short: not yet a whole JSON value
        json.loads(call.function.arguments)
    assert call.function.arguments.startswith("{")
    streamed, finish = _reassemble(client.chat.completions.create(**fields, stream=True))
    assert finish == "length"
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (call.function.name, call.function.arguments)
    ]


def test_follow_up_turn_with_the_tool_result(client: openai.OpenAI) -> None:
    first = _create(client, messages=MESSAGES, tool_choice="required").choices[0].message
    history = [
        *MESSAGES,
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "21 degrees, sunny"},
    ]
    response = _create(
        client, messages=history, tool_choice="none", extra_body={"return_prompt_text": True}
    )
    answer = response.choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.content
    assert not answer.message.tool_calls
    prompt = response.model_extra["prompt_text"]
    # The call and its result are in the prompt, in the default (Hermes) rendering.
    assert f'"name": "{first.tool_calls[0].function.name}"' in prompt
    assert "<tool_response>\n21 degrees, sunny\n</tool_response>" in prompt
    assert "<tools>" in prompt and '"name": "get_time"' in prompt


@pytest.mark.parametrize(
    ("tool_choice", "stop"),
    [("required", ["}", ",", "\n"]), ({"type": "function", "function": {"name": "get_weather"}},
                                     ["}", '"'])],
    ids=["required", "named"],
)
def test_stop_strings_do_not_cut_a_tool_answer(
    client: openai.OpenAI, tool_choice: Any, stop: list[str]
) -> None:
    """(A stop string inside the grammar's JSON ended the answer with finish_reason
    "tool_calls" and arguments that did not parse.) Stops apply to text answers only."""
    want_finish = "stop" if isinstance(tool_choice, dict) else "tool_calls"
    choice = _create(client, messages=MESSAGES, tool_choice=tool_choice, stop=stop).choices[0]
    assert choice.finish_reason == want_finish and choice.stop_reason is None, choice
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    streamed, finish = _reassemble(
        _create(client, messages=MESSAGES, tool_choice=tool_choice, stop=stop, stream=True)
    )
    assert finish == want_finish
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]
    # A text answer still stops at them.
    text = _create(client, messages=MESSAGES, tool_choice="none", stop=[" "]).choices[0]
    assert text.finish_reason == "stop" and " " not in (text.message.content or "").strip()


@pytest.mark.parametrize(
    "response_format",
    [{"type": "json_object"},
     {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "integer"}}}],
)
def test_a_forced_call_with_a_response_format_is_a_call(
    client: openai.OpenAI, response_format: dict[str, Any]
) -> None:
    """(Was a 400; OpenAI and vLLM accept the pair, and agent SDKs send it: the format is
    for the final text answer, the forced choice for this turn's call.)"""
    choice = _create(client, messages=MESSAGES, tool_choice="required",
                     response_format=response_format).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_a_streamed_required_answer_sends_no_empty_chunks(client: openai.OpenAI) -> None:
    """(One empty chunk went out per token while the calls were held back; vLLM sends
    none.) Past the role chunk every chunk carries calls or the finish reason."""
    chunks = list(_create(client, messages=MESSAGES, tool_choice="required", stream=True))
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert deltas[0].delta.role == "assistant"
    for choice in deltas[1:]:
        assert choice.delta.tool_calls or choice.finish_reason, choice
    # With logprobs, each token's chunk still goes out: it carries the token.
    with_logprobs = list(_create(client, messages=MESSAGES, tool_choice="required", stream=True,
                                 logprobs=True))
    tokens = [t for c in with_logprobs if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.content or []]
    completion = _create(client, messages=MESSAGES, tool_choice="required")
    assert len(tokens) == completion.usage.completion_tokens


# ---------------------------------------------------------------- fixed texts

PARSED_TOOLS = parse_tools(TOOLS)
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


def test_hermes_auto_answers() -> None:
    auto = ToolChoice("auto")
    answer = parse_answer("Let me check.\n" + CALL_TEXT + "\n" + CALL_TEXT, PARSED_TOOLS, auto)
    # The text before the call as it streamed, not stripped (vLLM's Hermes parser).
    assert answer.content == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in answer.calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})
    ] * 2
    assert len(parse_answer(CALL_TEXT * 2, PARSED_TOOLS, auto, parallel=False).calls) == 1
    # Unknown names and broken JSON stay text.
    for text in [
        "Paris is sunny.",
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
        "<tool_call>{oops",
    ]:
        assert parse_answer(text, PARSED_TOOLS, auto) == parse_answer(
            text, PARSED_TOOLS, ToolChoice("none")
        )
        assert parse_answer(text, PARSED_TOOLS, auto).content == text


def test_required_answers_hold_every_call() -> None:
    """A required answer is a JSON array of calls (vLLM's form): each one is a tool call,
    in order, its arguments as JSON text."""
    required = ToolChoice("required")
    text = ('[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},\n'
            ' {"name": "get_time", "arguments": {"timezone": "CET"}}]')
    answer = parse_answer(text, PARSED_TOOLS, required)
    assert answer.content is None
    assert [(c.name, json.loads(c.arguments)) for c in answer.calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "CET"})
    ]
    assert len({c.id for c in answer.calls}) == 2
    streamer = ToolCallStreamer(PARSED_TOOLS, required)
    assert streamer.feed(text) == ("", [])
    rest, calls = streamer.finish()
    assert rest == "" and [(c["index"], c["function"]["name"]) for c in calls] == [
        (0, "get_weather"), (1, "get_time")
    ]


def test_required_grammar_allows_parallel_calls_unless_told_not_to() -> None:
    both = tool_constraint(PARSED_TOOLS, ToolChoice("required")).json
    one = tool_constraint(PARSED_TOOLS, ToolChoice("required"), parallel=False).json
    assert isinstance(both, dict) and isinstance(one, dict)
    call = {"name": "get_time", "arguments": {"timezone": "CET"}}
    jsonschema.validate([call, call], both)
    jsonschema.validate([call], one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([call, call], one)
    for bad in ([], call, [{"name": "get_time", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, both)


def test_constrained_answers_cut_short() -> None:
    required, named = ToolChoice("required"), ToolChoice("named", "get_weather")
    cut = '[{"name": "get_weather", "arguments": {"city": "Par'
    (call,) = parse_answer(cut, PARSED_TOOLS, required).calls
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Par')
    # Cut in the second call: the first whole, the second as far as it got.
    first = '[{"name": "get_time", "arguments": {"timezone": "CET"}}, '
    calls = parse_answer(first + cut[1:], PARSED_TOOLS, required).calls
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_time", '{"timezone": "CET"}'), ("get_weather", '{"city": "Par')
    ]
    (call,) = parse_answer(first, PARSED_TOOLS, required).calls  # cut before the second
    assert call.name == "get_time"
    answer = parse_answer('{"city": "Par', PARSED_TOOLS, named)
    assert answer.content is None
    assert [(c.name, c.arguments) for c in answer.calls] == [("get_weather", '{"city": "Par')]
    # Cut once the name is complete but before the arguments begin: the call, no arguments
    # yet; cut inside the first name: no call, the text stays content.
    for text in ['[{"name": "get_weather"', '[\n  {\n  "name": "get_weather",\n  "',
                 '[{"name": "get_weather", "argu', '[{"name": "get_weather", "arguments": ']:
        answer = parse_answer(text, PARSED_TOOLS, required)
        assert answer.content is None, text
        assert [(c.name, c.arguments) for c in answer.calls] == [("get_weather", "")], text
    # Cut before the first name is complete: no call, and no content either (the
    # grammar's JSON array is not the model's words), streamed or not.
    for text in ['[', '[{"name": "get_wea', '[{"name": "get_weather", "x"']:
        answer = parse_answer(text, PARSED_TOOLS, required)
        assert answer.content is None and answer.calls == [], text
        streamer = ToolCallStreamer(PARSED_TOOLS, required)
        assert streamer.feed(text) == ("", []) and streamer.finish() == ("", []), text
    # Streamed, a cut required answer ends with the same call.
    streamer = ToolCallStreamer(PARSED_TOOLS, required)
    assert streamer.feed(cut) == ("", [])
    rest, calls = streamer.finish()
    assert rest == "" and [c["function"]["arguments"] for c in calls] == ['{"city": "Par']


def test_streamed_auto_answer_holds_back_the_tool_call() -> None:
    streamer = ToolCallStreamer(PARSED_TOOLS, ToolChoice("auto"))
    text = "Sure. " + CALL_TEXT
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    sent = [streamer.feed(p) for p in pieces]
    content = "".join(c for c, _ in sent)
    assert content == "Sure. " and all(not calls for _, calls in sent)
    # the same content as the whole answer's (no strip on either side)
    assert parse_answer(text, PARSED_TOOLS, ToolChoice("auto")).content == content
    rest, calls = streamer.finish()
    assert rest == "" and streamer.has_calls
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})
    ]
    plain = ToolCallStreamer(PARSED_TOOLS, ToolChoice("auto"))
    assert "".join(plain.feed(p)[0] for p in ["a <", "b", " c"]) + plain.finish()[0] == "a <b c"


def test_default_rendering_of_history() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"timezone": "UTC"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    system, assistant, tool = render_tool_messages(messages, PARSED_TOOLS)
    assert system["content"].startswith("Be brief.\n\n") and "<tools>" in system["content"]
    assert assistant["content"] == (
        '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>'
    )
    assert tool["content"] == "<tool_response>\n12:00\n</tool_response>"


BAD = [
    ({"tools": {"type": "function"}}, "tools"),
    # An empty array, as OpenAI and vLLM 0.32 refuse it (was taken as no tools).
    ({"tools": []}, "tools"),
    ({"tools": [], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    # Arguments are a JSON object: OpenAI refuses any other parameters schema.
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools"),
    # Not dropped in silence: a description or strict of the wrong type.
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 5}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    # The Responses API's flat named choice, sent to chat.
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "get_time"}}, "tool_choice"),
    # A forced call's grammar wins over a format, but a malformed format is still refused.
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "xml"}},
     "response_format"),
]


@pytest.mark.parametrize(("patch", "param"), BAD)
def test_bad_tools_are_400s_and_the_server_keeps_serving(
    tiny_server: ServerProcess, patch: dict[str, Any], param: str
) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w3"}], "max_tokens": 2}
    url = f"{tiny_server.url}/v1/chat/completions"
    response = httpx.post(url, json=body | patch, headers=AUTH, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text
    ok = httpx.post(url, json=body, headers=AUTH, timeout=60)
    assert ok.status_code == 200, ok.text


def test_parameters_are_an_object_schema_named_as_the_client_wrote_it() -> None:
    def error(tool: dict[str, Any], flat: bool = False) -> str:
        with pytest.raises(OpenAIError) as caught:
            parse_tools([tool], flat=flat)
        return caught.value.message

    nested = {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
    assert "tools[0].function.parameters must be a JSON schema of type 'object'" in error(nested)
    flat = {"type": "function", "function": {"name": "bad name"}}  # as Responses' tools arrive
    assert error(flat, flat=True).startswith("tools[0].name must be")
    # Missing, empty and untyped parameters are object schemas.
    untyped = {"properties": {"a": {"type": "integer"}}}
    for parameters, want in [(None, {}), ({}, {}), (untyped, untyped["properties"])]:
        (tool,) = parse_tools([{"type": "function",
                                "function": {"name": "f", "parameters": parameters}}])
        assert tool.parameters["type"] == "object"
        assert tool.parameters["properties"] == want


def test_tool_schema_errors_name_the_function_and_its_own_paths() -> None:
    """(Required choices reported pointers into the grammar's wrapper, ``/$defs/tool_f/...``.)"""
    broken = parse_tools([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/Nope"}}}}}, TOOLS[0]])
    for choice in (ToolChoice("required"), ToolChoice("named", "f")):
        with pytest.raises(OpenAIError) as caught:
            tool_constraint(broken, choice)
        message = caught.value.message
        assert message.startswith("Invalid function 'f' parameters:"), message
        assert "'/$defs/Nope'" in message and "tool_f" not in message, message
        assert caught.value.param == "tools"
    # A tool that is not chosen is not compiled.
    assert tool_constraint(broken, ToolChoice("named", "get_weather")).json is not None


def test_stops_are_kept_for_text_answers_only() -> None:
    params = SamplingParams(stop=["}"], stop_token_ids=[7])
    for mode in ("required", "named"):
        kept = tool_answer_params(params, ToolChoice(mode, "f"))
        assert kept.stop == [] and kept.stop_token_ids == []
    for mode in ("none", "auto"):
        assert tool_answer_params(params, ToolChoice(mode)) is params
    assert params.stop == ["}"]  # the request's own params are not changed


def test_a_template_with_a_tool_format_renders_the_tools(tiny_server: ServerProcess) -> None:
    template = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "w3"}],
        "max_tokens": 2,
        "tools": TOOLS,
        "chat_template": template,
        "return_prompt_text": True,
    }
    url = f"{tiny_server.url}/v1/chat/completions"
    response = httpx.post(url, json=body, headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    # The template's own rendering, not the default Hermes prompt.
    assert response.json()["prompt_text"] == "[get_weather][get_time]w3"
