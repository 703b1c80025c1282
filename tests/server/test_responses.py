"""``POST /v1/responses`` (OpenAI's Responses API) through the official ``openai`` client.

The reference is the chat route: the same conversation as chat messages must render to
the same prompt (equal ``input_tokens``) and give the same greedy answer, streamed or not.
Most checks run on the shared tiny server; the chat template's real rendering,
``text.format`` grammars and required/named tool choices run on the default model
(llguidance cannot read the tiny model's word-level tokenizer). The field table is
checked against OpenAI's ``ResponseCreateParams`` (installed ``openai`` package) and
vLLM 0.32.0's ``ResponsesRequest`` (``vllm/entrypoints/openai/responses/protocol.py``).
Streaming with tool calls and a failing engine are checked on fixed deltas, without a
model.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from inprocess_server import InProcessServer
from openai.types.responses import response_create_params
from pydantic import BaseModel
from server_harness import API_KEY, CHAT_TEMPLATE, ServerProcess

from helpers.tiny_model import with_generation_config
from inflight.engine.request_stream import EngineDeadError, RequestDelta
from inflight.entrypoints.openai.protocol_responses import ResponsesRequest
from inflight.entrypoints.openai.request_fields import RESPONSES_FIELDS, Implemented, Refused
from inflight.entrypoints.openai.responses_stream import stream_response
from inflight.entrypoints.openai.serving_responses import ResponseReply, _complete
from inflight.entrypoints.openai.tool_calls import ToolChoice, parse_tools
from inflight.entrypoints.openai.tool_parsing import parse_answer
from inflight.outputs import Logprob
from inflight.sampling_params import SamplingParams

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TINY = "tiny"
MODEL = "SmolLM2-135M-Instruct"
# ignore_eos: the tiny model's answers run to max_output_tokens, so they are long enough
# to tell two prompts apart.
GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def _responses(client: openai.OpenAI, **fields: Any) -> Any:
    return client.responses.create(**({"model": TINY, **GREEDY} | fields))


def _chat(client: openai.OpenAI, messages: list[Any], max_tokens: int, **fields: Any) -> Any:
    return client.chat.completions.create(
        **({"model": TINY, **GREEDY} | fields), messages=messages, max_tokens=max_tokens
    )


def _assert_same_answer(response: Any, chat: Any) -> None:
    """Same prompt (token count) and same greedy tokens as the chat completion."""
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens


def _post(server: ServerProcess, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/responses", json=body, headers=AUTH, timeout=60)


def _sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    """A raw event stream as (``event:`` name, ``data:`` JSON) pairs."""
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((lines["event"], json.loads(lines["data"])))
    return events


# ---------------------------------------------------------------- equal to chat (tiny)


def test_string_input_and_instructions_equal_chat(client: openai.OpenAI) -> None:
    response = _responses(client, input="w3 w4", instructions="w5 w6", max_output_tokens=6)
    chat = _chat(client, [{"role": "system", "content": "w5 w6"},
                          {"role": "user", "content": "w3 w4"}], 6)
    _assert_same_answer(response, chat)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "incomplete" and response.output_text
    # The instructions were rendered: without them the prompt is shorter.
    bare = _responses(client, input="w3 w4", max_output_tokens=6)
    assert bare.usage.input_tokens == response.usage.input_tokens - 2
    _assert_same_answer(bare, _chat(client, [{"role": "user", "content": "w3 w4"}], 6))


def test_item_list_input_equals_chat(client: openai.OpenAI) -> None:
    items: list[Any] = [
        {"role": "developer", "content": "w7"},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "w3"}, {"type": "input_text", "text": "w4"}]},
        {"type": "message", "role": "assistant", "status": "completed", "id": "msg_1",
         "content": [{"type": "output_text", "text": "w9 w10", "annotations": []}]},
        {"role": "user", "content": "w11"},
    ]
    messages = [
        {"role": "developer", "content": "w7"},
        {"role": "user", "content": [{"type": "text", "text": "w3"}, {"type": "text", "text": "w4"}]},
        {"role": "assistant", "content": "w9 w10"},
        {"role": "user", "content": "w11"},
    ]
    response = _responses(client, input=items, max_output_tokens=5)
    _assert_same_answer(response, _chat(client, messages, 5))
    assert response.usage.input_tokens == 6  # every item's words (the template joins them)


def test_function_call_items_render_as_chat_tool_calls(client: openai.OpenAI) -> None:
    tools: list[Any] = [{"type": "function", "name": "lookup", "description": "w12",
                         "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}]
    chat_tools: list[Any] = [{"type": "function", "function": {
        "name": "lookup", "description": "w12", "parameters": tools[0]["parameters"]}}]
    items: list[Any] = [
        {"role": "user", "content": "w3"},
        {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": '{"q": "w4"}'},
        {"type": "function_call", "call_id": "call_2", "name": "lookup", "arguments": '{"q": "w5"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "w6"},
        {"type": "function_call_output", "call_id": "call_2", "output": "w7"},
    ]
    calls = [{"id": f"call_{i}", "type": "function",
              "function": {"name": "lookup", "arguments": f'{{"q": "w{i + 3}"}}'}} for i in (1, 2)]
    messages: list[Any] = [
        {"role": "user", "content": "w3"},
        {"role": "assistant", "content": None, "tool_calls": calls},  # one turn, both calls
        {"role": "tool", "tool_call_id": "call_1", "content": "w6"},
        {"role": "tool", "tool_call_id": "call_2", "content": "w7"},
    ]
    response = _responses(client, input=items, tools=tools, tool_choice="none", max_output_tokens=5)
    chat = _chat(client, messages, 5, tools=chat_tools, tool_choice="none")
    _assert_same_answer(response, chat)
    # Each call went into the prompt: one fewer, and the prompt is shorter.
    fewer = _responses(client, input=items[:2] + items[3:4], tools=tools, tool_choice="none",
                       max_output_tokens=5)
    assert fewer.usage.input_tokens < response.usage.input_tokens


def test_max_output_tokens_cuts_and_stop_completes(client: openai.OpenAI) -> None:
    cut = _responses(client, input="w3 w4", max_output_tokens=4)
    assert cut.status == "incomplete"
    assert cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"
    (message,) = cut.output
    assert message.type == "message" and message.status == "incomplete"
    assert message.role == "assistant" and message.id.startswith("msg_")
    assert cut.usage.output_tokens == 4 and cut.max_output_tokens == 4
    words = cut.output_text.split()
    # A stop string (vLLM's extra) ends the answer before the limit: complete.
    stopped = _responses(client, input="w3 w4", max_output_tokens=4,
                         extra_body={"ignore_eos": True, "stop": [words[1]]})
    assert stopped.status == "completed" and stopped.incomplete_details is None
    assert stopped.output_text.split() == words[:1]
    assert stopped.output[0].status == "completed"
    assert stopped.usage.output_tokens == 2  # the stop word's token is generated, not shown


def test_request_settings_are_echoed(client: openai.OpenAI) -> None:
    tools: list[Any] = [{"type": "function", "name": "f", "parameters": {"type": "object"},
                         "strict": False}]
    response = _responses(
        client, input="w3", instructions="w5", max_output_tokens=3, temperature=0.5,
        top_p=0.9, tools=tools, tool_choice="none", parallel_tool_calls=False,
        text={"format": {"type": "text"}}, truncation="disabled", metadata={"k": "v"},
        user="u1", service_tier="auto", store=True,
        extra_body={"request_id": "resp_mine", "seed": 3},
    )
    assert response.id == "resp_mine"  # vLLM: the request_id is the response's id
    assert response.instructions == "w5" and response.max_output_tokens == 3
    assert response.temperature == 0.5 and response.top_p == 0.9
    assert response.tool_choice == "none" and response.parallel_tool_calls is False
    assert [t.name for t in response.tools] == ["f"]
    assert response.text.format.type == "text" and response.truncation == "disabled"
    assert response.metadata == {"k": "v"} and response.user == "u1"
    assert response.error is None and response.background is False
    assert response.model == TINY and response.created_at > 1.7e9
    details = response.usage
    assert details.input_tokens_details.cached_tokens >= 0
    assert details.output_tokens_details.reasoning_tokens == 0
    # Unset: OpenAI's defaults, and vLLM's effective limit for max_output_tokens (what the
    # context leaves: max_model_len is 512 here).
    plain = _responses(client, input="w3 " * 500)
    assert plain.tool_choice == "auto" and plain.tools == [] and plain.temperature == 0
    assert plain.text.format.type == "text" and plain.metadata == {}
    assert plain.max_output_tokens == 512 - 500 == plain.usage.output_tokens
    assert plain.status == "incomplete"


def test_vllm_s_response_keys_are_carried(tiny_server: ServerProcess) -> None:
    """Every key of vLLM 0.32's Response object is there (found by vllm_diff_server.py):
    its extras as null, the penalties as applied, per-turn usage lists empty (one turn)."""
    body = _post(tiny_server, {"model": TINY, "input": "w3", "max_output_tokens": 2,
                               "presence_penalty": 0.5}).json()
    assert body["presence_penalty"] == 0.5 and body["frequency_penalty"] == 0.0
    for key in ("prompt", "kv_transfer_params", "ec_transfer_params", "input_messages",
                "output_messages"):
        assert key in body and body[key] is None, key
    assert body["output"][0]["phase"] is None
    assert body["usage"]["input_tokens_details"] | {"cached_tokens": 0} == {
        "cached_tokens": 0, "cache_write_tokens": 0, "input_tokens_per_turn": [],
        "cached_tokens_per_turn": []}
    assert body["usage"]["output_tokens_details"] == {
        "reasoning_tokens": 0, "tool_output_tokens": 0, "output_tokens_per_turn": [],
        "tool_output_tokens_per_turn": []}


def test_logprobs_equal_chat(client: openai.OpenAI) -> None:
    response = _responses(client, input="w3 w4", max_output_tokens=4, top_logprobs=2,
                          include=["message.output_text.logprobs"])
    chat = _chat(client, [{"role": "user", "content": "w3 w4"}], 4, logprobs=True, top_logprobs=2)
    logprobs = response.output[0].content[0].logprobs
    expected = chat.choices[0].logprobs.content
    assert len(logprobs) == response.usage.output_tokens == 4
    assert [(e.token, e.logprob, e.bytes) for e in logprobs] == [
        (e.token, e.logprob, e.bytes) for e in expected]
    assert [[(t.token, t.logprob) for t in e.top_logprobs] for e in logprobs] == [
        [(t.token, t.logprob) for t in e.top_logprobs] for e in expected]
    assert all(len(e.top_logprobs) == 2 for e in logprobs)
    assert response.top_logprobs == 2
    # Without include, no logprobs (vLLM's rule).
    plain = _responses(client, input="w3 w4", max_output_tokens=4, top_logprobs=2)
    assert plain.output[0].content[0].logprobs is None and plain.top_logprobs is None


def test_the_model_s_generation_config_is_the_default(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """As on chat (and in vLLM): fields the request leaves out come from the model's
    generation config, whose max_new_tokens caps even max_output_tokens."""
    configured = with_generation_config(tiny_llama_dir, tmp_path / "tiny", max_new_tokens=4,
                                        temperature=0.0, repetition_penalty=1.3)
    server = InProcessServer(configured, chat_template=CHAT_TEMPLATE).start()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        silent = client.responses.create(model=TINY, input="w3 w4",
                                         extra_body={"ignore_eos": True})
        explicit = client.responses.create(
            model=TINY, input="w3 w4", temperature=0, max_output_tokens=10,
            extra_body={"ignore_eos": True, "repetition_penalty": 1.3})
        chat = client.chat.completions.create(model=TINY, extra_body={"ignore_eos": True},
                                              messages=[{"role": "user", "content": "w3 w4"}])
        assert silent.output_text == explicit.output_text == chat.choices[0].message.content
        assert silent.usage.output_tokens == explicit.usage.output_tokens == 4
        assert silent.temperature == 0 and silent.max_output_tokens == 4
    finally:
        server.stop()


# ---------------------------------------------------------------- streaming (tiny)

TEXT_EVENTS = [
    "response.created", "response.in_progress", "response.output_item.added",
    "response.content_part.added",
]
TEXT_END = [
    "response.output_text.done", "response.content_part.done", "response.output_item.done",
    "response.completed",
]


def test_stream_events_in_order_and_equal_to_the_unstreamed(
    client: openai.OpenAI, tiny_server: ServerProcess
) -> None:
    fields: dict[str, Any] = dict(input="w3 w4", instructions="w5", max_output_tokens=5)
    events = list(_responses(client, stream=True, **fields))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == TEXT_EVENTS + ["response.output_text.delta"] * len(deltas) + TEXT_END
    assert [e.sequence_number for e in events] == list(range(len(events)))
    unstreamed = _responses(client, **fields)
    final = events[-1].response
    assert "".join(d.delta for d in deltas) == final.output_text == unstreamed.output_text
    assert len(deltas) == 5  # one per engine delta: one per token here
    item_id = events[2].item.id
    assert {e.item_id for e in deltas} == {item_id} == {final.output[0].id}
    assert {(e.output_index, e.content_index) for e in deltas} == {(0, 0)}
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert final.status == "incomplete" and final.id == events[0].response.id
    assert final.usage == unstreamed.usage
    assert events[-4].text == final.output_text  # output_text.done
    # Raw: every data line has its event line, no [DONE].
    raw = _post(tiny_server, {"model": TINY, "temperature": 0, "stream": True, **fields})
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in raw.text
    assert [name for name, data in _sse(raw.text) if name == data["type"]] == kinds


def test_stream_helper_final_response(client: openai.OpenAI) -> None:
    with client.responses.stream(model=TINY, input="w3 w4", max_output_tokens=3,
                                 temperature=0) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == "".join(texts) != ""
    assert final.output_text == _responses(client, input="w3 w4", max_output_tokens=3).output_text


def test_streamed_logprobs_join_to_the_unstreamed(client: openai.OpenAI) -> None:
    fields: dict[str, Any] = dict(input="w3 w4", max_output_tokens=4, top_logprobs=1,
                                  include=["message.output_text.logprobs"])
    events = list(_responses(client, stream=True, **fields))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    unstreamed = _responses(client, **fields).output[0].content[0].logprobs
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in done.logprobs]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in unstreamed]
    assert len(streamed) == 4


# ---------------------------------------------------------------- errors (tiny)


@pytest.mark.parametrize(
    ("patch", "status", "param", "words"),
    [
        ({"input": ""}, 400, "input", "non-empty"),
        ({"input": []}, 400, "input", "non-empty"),
        ({"input": 5}, 400, "input", "Invalid type"),
        ({"model": "nope"}, 404, "model", "does not exist"),
        ({"max_output_tokens": "8"}, 400, "max_output_tokens", "Invalid value"),
        ({"temperature": 3}, 400, "temperature", "less than or equal"),
        ({"top_logprobs": 21}, 400, "top_logprobs", "less than or equal"),
        ({"input": "w3 " * 600}, 400, "input", "maximum context length"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         400, "input", "input_image"),
        ({"input": [{"role": "tool", "content": "w3"}]}, 400, "input", "role"),
        ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input", "reasoning"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input", "item_reference"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]},
         400, "input", "JSON"),
        ({"input": [{"type": "function_call_output", "output": "w3"}]}, 400, "input", "call_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, 400, "input",
         "input[0].output must be"),
        ({"input": [{"role": "user", "content": [{"type": "text", "text": "w3"}]}]}, 400,
         "input", "'input_text'"),
        ({"tools": [{"type": "web_search"}]}, 400, "tools", "web_search"),
        # Named as the client wrote them: flat Responses tools have no "function" level.
        ({"tools": [{"type": "function", "name": "bad name"}]}, 400, "tools",
         "tools[0].name must"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]}, 400,
         "tools", "tools[0].parameters must be a JSON schema of type 'object'"),
        ({"tools": [{"type": "function", "name": "f", "strict": 1}]}, 400, "tools",
         "tools[0].strict must be a boolean"),
        ({"tools": [{"type": "function", "name": "f", "defer_loading": True}]}, 400, "tools",
         "defer_loading"),
        ({"tool_choice": "required"}, 400, "tool_choice", "tools"),
        # Errors describe the Responses forms, not chat's.
        ({"tools": [{"type": "function", "name": "f"}],
          "tool_choice": {"type": "function", "function": {"name": "f"}}}, 400, "tool_choice",
         "{'type': 'function', 'name': ...}, got {'type': 'function', 'function': {'name': 'f'}}"
         " (chat's nested form"),
        ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function"}},
         400, "tool_choice", "{'type': 'function', 'name': ...}"),
        ({"tools": [{"type": "function", "name": "f"}], "tool_choice": "requird"}, 400,
         "tool_choice", "{'type': 'function', 'name': ...}, got 'requird'"),
        ({"tool_choice": {"type": "web_search_preview"}}, 400, "tool_choice",
         "web_search_preview"),
        ({"tools": [{"type": "function", "name": "f"}],
          "tool_choice": {"type": "function", "name": "g"}}, 400, "tool_choice", "'g'"),
        ({"text": {"format": {"type": "xml"}}}, 400, "text.format", "xml"),
        ({"text": {"format": "json"}}, 400, "text.format", "object"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format",
         "'schema'"),
        ({"service_tier": "bogus"}, 400, "service_tier", "auto"),
        ({"text": {"verbosity": "low"}}, 400, "text.verbosity", "verbosity"),
        ({"include": ["everything"]}, 400, "include", "everything"),
        ({"top_k": -2}, 400, "top_k", "greater than or equal"),
    ],
)
def test_bad_requests_are_openai_errors(
    tiny_server: ServerProcess, patch: dict[str, Any], status: int, param: str, words: str
) -> None:
    response = _post(tiny_server, {"model": TINY, "input": "w3", "max_output_tokens": 2} | patch)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_context_overflow_uses_vllms_wording(tiny_server: ServerProcess) -> None:
    error = _post(tiny_server, {"model": TINY, "input": "w3 " * 600}).json()
    assert error["error"]["code"] == "context_length_exceeded"
    assert error["error"]["message"].startswith("This model's maximum context length is ")


def test_max_output_tokens_past_the_context_is_cut_to_the_room_left(client: openai.OpenAI) -> None:
    """As vLLM 0.32: the limit is clamped to what the context leaves, and echoed so."""
    response = _responses(client, input="w3 " * 500, max_output_tokens=100000)
    assert response.max_output_tokens == 512 - 500 == response.usage.output_tokens
    assert response.status == "incomplete"


def test_api_key_is_required(tiny_server: ServerProcess) -> None:
    response = httpx.post(f"{tiny_server.url}/v1/responses", json={"input": "w3"}, timeout=30)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


# ---------------------------------------------------------------- the field table

# vLLM 0.32.0's; earlier versions also had previous_response (still refused by name).
VLLM_RESPONSES_FIELDS = """
    background include input instructions max_output_tokens max_tool_calls metadata model
    logit_bias parallel_tool_calls previous_response_id prompt reasoning include_reasoning
    service_tier store stream temperature text tool_choice tools top_logprobs top_p top_k
    min_p truncation user skip_special_tokens include_stop_str_in_output presence_penalty
    frequency_penalty prompt_cache_key watermarking request_id session_id media_io_kwargs
    mm_processor_kwargs priority mm_payload return_mm_kwargs cache_salt
    enable_response_messages previous_input_messages structured_outputs repetition_penalty
    seed stop stop_token_ids ignore_eos vllm_xargs kv_transfer_params ec_transfer_params
    chat_template_kwargs
""".split()
OPENAI_RESPONSES_FIELDS = set(response_create_params.ResponseCreateParamsBase.__annotations__)
OPENAI_RESPONSES_FIELDS |= set(response_create_params.ResponseCreateParamsStreaming.__annotations__)

FUNCTION = [{"type": "function", "name": "f"}]
LOGPROBS = ["message.output_text.logprobs"]
IMPLEMENTED: dict[str, dict[str, Any]] = {
    "model": {"model": ""},
    "input": {"input": [{"role": "user", "content": "w3"}]},
    "instructions": {"instructions": "w5"},
    "max_output_tokens": {"max_output_tokens": 3},
    "temperature": {"temperature": 0.7, "seed": 1},
    "top_p": {"top_p": 0.9},
    "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_obfuscation": False}},
    "tools": {"tools": FUNCTION},
    "tool_choice": {"tools": FUNCTION, "tool_choice": "none"},
    "parallel_tool_calls": {"parallel_tool_calls": False},
    "text": {"text": {"format": {"type": "text"}}},
    "include": {"include": LOGPROBS},
    "top_logprobs": {"include": LOGPROBS, "top_logprobs": 2},
    "metadata": {"metadata": {"k": "v"}},
    "user": {"user": "user-1"},
    "safety_identifier": {"safety_identifier": "user-1"},
    "store": {"store": True},
    "service_tier": {"service_tier": "auto"},
    "max_tool_calls": {"max_tool_calls": 2},
    "prompt_cache_key": {"prompt_cache_key": "key"},
    "prompt_cache_options": {"prompt_cache_options": {"ttl": "30m"}},
    "prompt_cache_retention": {"prompt_cache_retention": "24h"},
    "request_id": {"request_id": "resp_mine"},
    "top_k": {"top_k": 5},
    "logit_bias": {"logit_bias": {"5": 1.0}},
    "repetition_penalty": {"repetition_penalty": 1.2},
    "seed": {"seed": 7, "temperature": 1.0},
    "stop": {"stop": ["w9"]},
    "ignore_eos": {"ignore_eos": True},
    "skip_special_tokens": {"skip_special_tokens": False},
    "include_stop_str_in_output": {"include_stop_str_in_output": True},
    "priority": {"priority": 0},
    "cache_salt": {"cache_salt": "salt"},
    "request_timeout": {"request_timeout": 600.0},  # inflight's extension
    "min_p": {"min_p": 0.1},
    "presence_penalty": {"presence_penalty": 0.5},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "stop_token_ids": {"stop_token_ids": [9]},
    "session_id": {"session_id": "session-1"},
    "include_reasoning": {"include_reasoning": False},
    "chat_template_kwargs": {"chat_template_kwargs": {"enable_thinking": False}},
    "mm_payload": {"mm_payload": "none"},
    "return_mm_kwargs": {"return_mm_kwargs": False},
}
DEFAULT_MODEL_ONLY = {"structured_outputs"}  # a grammar: test_structured_outputs_extra
# Refused fields: (a value that must be refused, the neutral value that must still work).
REFUSED: dict[str, tuple[Any, Any]] = {
    "truncation": ("auto", "disabled"),
    "background": (True, False),
    "background_options": ({"completion_window": "2h"}, None),
    "previous_response_id": ("resp_123", None),
    "conversation": ("conv_123", None),
    "prompt": ({"id": "pmpt_1"}, None),
    "reasoning": ({"effort": "high"}, {"effort": None, "summary": None}),
    "context_management": ([{"type": "compaction"}], None),
    "access_programs": ({"cyber": "standard"}, None),
    "image": ({"context_compression": "enabled"}, None),
    "moderation": ({"model": "omni-moderation-latest"}, None),
    "mm_processor_kwargs": ({"size": 1}, None),
    "enable_response_messages": (True, False),
    "previous_input_messages": ([{"role": "user", "content": "w3"}], None),
    "previous_response": ({"id": "resp_1"}, None),
    "vllm_xargs": ({"x": 1}, None),
    "watermarking": (True, False),
    "kv_transfer_params": ({"do_remote_decode": True}, None),
    "ec_transfer_params": ({"x": 1}, None),
    "media_io_kwargs": ({"image": {"mode": "RGB"}}, None),
}
BASE: dict[str, Any] = {"model": TINY, "input": "w3 w4", "max_output_tokens": 2, "temperature": 0}


def test_every_schema_field_has_a_treatment() -> None:
    assert sorted(OPENAI_RESPONSES_FIELDS - set(RESPONSES_FIELDS)) == []
    assert sorted(set(VLLM_RESPONSES_FIELDS) - set(RESPONSES_FIELDS)) == []
    assert set(ResponsesRequest.model_fields) == set(RESPONSES_FIELDS)
    assert all(isinstance(t, (Implemented, Refused)) for t in RESPONSES_FIELDS.values())
    implemented = {n for n, t in RESPONSES_FIELDS.items() if isinstance(t, Implemented)}
    assert set(IMPLEMENTED) | DEFAULT_MODEL_ONLY == implemented
    assert set(REFUSED) == {n for n, t in RESPONSES_FIELDS.items() if isinstance(t, Refused)}


def _assert_ok(response: httpx.Response, stream: bool) -> None:
    assert response.status_code == 200, response.text
    if stream:
        assert _sse(response.text)[-1][0] == "response.completed"
    else:
        assert response.json()["status"] in ("completed", "incomplete")


def test_implemented_fields_are_accepted(tiny_server: ServerProcess) -> None:
    for name, patch in IMPLEMENTED.items():
        response = _post(tiny_server, BASE | patch)
        assert response.status_code == 200, (name, response.text)
        _assert_ok(response, bool(patch.get("stream")))


def test_refused_fields_are_named_unless_neutral(tiny_server: ServerProcess) -> None:
    for name, (value, neutral) in REFUSED.items():
        response = _post(tiny_server, BASE | {name: value})
        assert response.status_code == 400, (name, response.text)
        error = response.json()["error"]
        assert error["param"] == name, error
        assert error["code"] == "unsupported_parameter" and name in error["message"], error
        _assert_ok(_post(tiny_server, BASE | {name: neutral}), False)


def test_vllm_sampling_extras_equal_chat(client: openai.OpenAI) -> None:
    """vLLM's min_p, penalties and stop_token_ids act as on chat (not ignored)."""
    extras: dict[str, Any] = {
        "ignore_eos": True, "presence_penalty": 2.0, "frequency_penalty": 2.0, "min_p": 0.5,
    }
    plain = _responses(client, input="w3 w4", max_output_tokens=8)
    penalised = _responses(client, input="w3 w4", max_output_tokens=8, extra_body=extras)
    chat = _chat(client, [{"role": "user", "content": "w3 w4"}], 8, extra_body=extras)
    _assert_same_answer(penalised, chat)
    assert penalised.output_text != plain.output_text
    words = penalised.output_text.split()
    stop = {"stop_token_ids": [int(words[2][1:])]}  # the tiny vocabulary: "w<i>" is token i
    stopped = _responses(client, input="w3 w4", max_output_tokens=8, extra_body=extras | stop)
    assert stopped.output_text.split() == words[:2] and stopped.status == "completed"


def test_chat_template_kwargs_reach_the_template(tiny_llama_dir: Path) -> None:
    """vLLM's chat_template_kwargs render as on chat (not ignored)."""
    template = "{{ greeting }} {% for m in messages %}{{ m['content'] }} {% endfor %}"
    server = InProcessServer(tiny_llama_dir, chat_template=template).start()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        kwargs = {"chat_template_kwargs": {"greeting": "w9 w8"}}
        greeted = _responses(client, input="w3 w4", max_output_tokens=3, extra_body=kwargs)
        plain = _responses(client, input="w3 w4", max_output_tokens=3)
        assert greeted.usage.input_tokens == plain.usage.input_tokens + 2
        chat = _chat(client, [{"role": "user", "content": "w3 w4"}], 3, extra_body=kwargs)
        _assert_same_answer(greeted, chat)
    finally:
        server.stop()


def test_stream_options_are_typed(tiny_server: ServerProcess) -> None:
    body = BASE | {"stream": True, "stream_options": {"include_obfuscation": "yes"}}
    response = _post(tiny_server, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "stream_options"


# ---------------------------------------------------------------- fixed deltas, no model

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
CALL_TEXT = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class _FakeStream:
    """A RequestStream of fixed text pieces, optionally failing after them."""

    def __init__(self, pieces: list[str], fail: bool = False, logprobs: bool = False) -> None:
        self.pieces, self.fail, self.closed = pieces, fail, False
        self.logprobs = logprobs  # each piece one token, its text its decoded_token

    async def __aiter__(self) -> AsyncIterator[RequestDelta]:
        for index, piece in enumerate(self.pieces):
            last = index == len(self.pieces) - 1 and not self.fail
            logprobs = [{index: Logprob(-0.5, 1, piece)}] if self.logprobs else None
            yield RequestDelta(
                "r", piece, [index], num_prompt_tokens=3, num_output_tokens=index + 1,
                finished=last, finish_reason="stop" if last else None, logprobs=logprobs,
            )
        if self.fail:
            raise EngineDeadError("the step failed")

    def close(self) -> None:
        self.closed = True


def _reply(mode: str, name: str | None = None, logprobs: int | None = None) -> ResponseReply:
    return ResponseReply(
        request=ResponsesRequest(input="w3"), model=TINY, params=SamplingParams(logprobs=logprobs),
        max_output_tokens=16, tools=parse_tools(CHAT_TOOLS), tool_choice=ToolChoice(mode, name),
        decode=str, raw_bytes=None,
    )


def _run(
    stream: _FakeStream, mode: str, name: str | None = None, logprobs: int | None = None
) -> list[dict[str, Any]]:
    reply = _reply(mode, name, logprobs)

    async def read() -> list[str]:
        return [event async for event in stream_response(reply, stream)]

    events = [data for _, data in _sse("".join(asyncio.run(read())))]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert stream.closed
    return events


def test_streamed_auto_tool_call_matches_the_parsed_answer() -> None:
    pieces = [CALL_TEXT[i : i + 7] for i in range(0, len(CALL_TEXT), 7)]
    events = _run(_FakeStream(pieces), "auto")
    final = events[-1]["response"]
    answer = parse_answer(CALL_TEXT, parse_tools(CHAT_TOOLS), ToolChoice("auto"))
    message, call = final["output"]
    assert message["content"][0]["text"] == answer.content == "Sure. "
    assert message["status"] == "completed" and call["status"] == "completed"
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Paris"})
    assert call["type"] == "function_call" and call["call_id"].startswith("call_")
    kinds = [e["type"] for e in events]
    # The message closes before the call's item opens; the call comes whole at the end.
    assert kinds[-8:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]
    added = events[-5]
    assert added["output_index"] == 1 and added["item"]["arguments"] == ""
    assert "".join(e.get("delta", "") for e in events
                   if e["type"] == "response.output_text.delta") == "Sure. "


def test_a_message_before_a_call_has_its_own_tokens_logprobs_streamed_or_not() -> None:
    """(The message's logprobs covered the call's tokens too: 12 entries for "Sure. ",
    while its streamed text deltas carried 1.) Each piece is one token here."""
    pieces = [CALL_TEXT[i : i + 7] for i in range(0, len(CALL_TEXT), 7)]
    events = _run(_FakeStream(pieces, logprobs=True), "auto", logprobs=0)
    sent = [entry for e in events if e["type"] == "response.output_text.delta"
            for entry in e["logprobs"]]
    assert [entry["token"] for entry in sent] == ["Sure. <"]  # the text's one token
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert done["logprobs"] == sent
    streamed = events[-1]["response"]["output"][0]["content"][0]
    assert streamed["text"] == "Sure. " and streamed["logprobs"] == sent
    unstreamed = json.loads(bytes(asyncio.run(
        _complete(_reply("auto", logprobs=0), _FakeStream(pieces, logprobs=True))  # type: ignore[arg-type]
    ).body))
    message, call = unstreamed["output"]
    assert message["content"][0]["logprobs"] == sent and call["name"] == "get_weather"


def test_streamed_calls_each_close_before_the_next_opens() -> None:
    """(Item 1 was added before item 0 was done.) OpenAI finishes each output item before
    adding the next; the items equal the unstreamed answer's."""
    text = ('[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_weather", "arguments": {"city": "Rome"}}]')
    events = _run(_FakeStream([text[:30], text[30:]]), "required")
    item_events = [(e["type"].removeprefix("response."), e["output_index"]) for e in events
                   if "output_index" in e]
    assert item_events == [
        ("output_item.added", 0), ("function_call_arguments.delta", 0),
        ("function_call_arguments.done", 0), ("output_item.done", 0),
        ("output_item.added", 1), ("function_call_arguments.delta", 1),
        ("function_call_arguments.done", 1), ("output_item.done", 1),
    ]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [json.loads(c["arguments"]) for c in done] == [{"city": "Paris"}, {"city": "Rome"}]
    assert all(c["status"] == "completed" for c in done)
    assert events[-1]["response"]["output"] == done


def test_streamed_named_call_streams_its_arguments() -> None:
    pieces = ['{"city": ', '"Par', 'is"}']
    events = _run(_FakeStream(pieces), "named", "get_weather")
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert deltas == pieces
    (call,) = events[-1]["response"]["output"]
    assert call["arguments"] == "".join(pieces) and call["name"] == "get_weather"
    assert not [e for e in events if e["type"].startswith("response.output_text")]


def test_an_engine_failure_ends_the_stream_with_error_and_failed() -> None:
    events = _run(_FakeStream(["w3", " w4"], fail=True), "none")
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert "the step failed" in events[-2]["message"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert failed["output"][0]["content"][0]["text"] == "w3 w4"


# ---------------------------------------------------------------- the default model

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 16}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "description": "Weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                    "required": ["city"], "additionalProperties": False}},
    {"type": "function", "name": "get_time", "description": "Time in a zone", "parameters": TIME},
]


class City(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def smol(start_server: Callable[..., ServerProcess]) -> openai.OpenAI:
    server = start_server("--max-num-seqs", "4")
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_default_model_equals_chat_streamed_or_not(smol: openai.OpenAI) -> None:
    fields: dict[str, Any] = dict(model=MODEL, temperature=0, max_output_tokens=12,
                                  instructions="Answer in one short sentence.",
                                  input="What is the capital of France?")
    chat = smol.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=12,
        messages=[{"role": "system", "content": fields["instructions"]},
                  {"role": "user", "content": fields["input"]}])
    response = smol.responses.create(**fields)
    _assert_same_answer(response, chat)
    assert "Paris" in response.output_text
    with smol.responses.stream(**fields) as stream:
        final = stream.get_final_response()
    assert final.output_text == response.output_text
    assert final.usage is not None and final.usage.input_tokens == response.usage.input_tokens


def test_incomplete_final_assistant_message_is_continued(smol: openai.OpenAI) -> None:
    """vLLM's rule: a last assistant item in_progress/incomplete is continued, not answered
    (chat's continue_final_message, which leaves the template's end-of-turn off)."""
    items: list[Any] = [
        {"role": "user", "content": "Count to five, comma separated."},
        {"type": "message", "role": "assistant", "status": "incomplete", "id": "msg_1",
         "content": [{"type": "output_text", "text": "1, 2, 3,", "annotations": []}]},
    ]
    continued = smol.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=6,
        messages=[items[0], {"role": "assistant", "content": "1, 2, 3,"}],
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    response = smol.responses.create(model=MODEL, temperature=0, max_output_tokens=6, input=items)
    _assert_same_answer(response, continued)
    # A completed assistant message is answered instead: a new turn, another prompt.
    items[1]["status"] = "completed"
    answered = smol.responses.create(model=MODEL, temperature=0, max_output_tokens=6, input=items)
    assert answered.usage.input_tokens > response.usage.input_tokens


def test_default_model_renders_tool_history_as_chat(smol: openai.OpenAI) -> None:
    items: list[Any] = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "21 degrees, sunny"},
    ]
    messages: list[Any] = [
        items[0],
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"},
    ]
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                  for t in TOOLS]
    response = smol.responses.create(model=MODEL, input=items, tools=TOOLS, tool_choice="none",
                                     temperature=0, max_output_tokens=10)
    chat = smol.chat.completions.create(model=MODEL, messages=messages, tools=chat_tools,
                                        tool_choice="none", temperature=0, max_tokens=10)
    _assert_same_answer(response, chat)


def test_json_schema_text_format(smol: openai.OpenAI) -> None:
    response = smol.responses.create(
        model=MODEL, temperature=0, max_output_tokens=40, input="A person as JSON:",
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                         "strict": True}},
    )
    assert response.status == "completed", response
    jsonschema.validate(json.loads(response.output_text), PERSON)
    assert response.text.format.type == "json_schema"
    parsed = smol.responses.parse(model=MODEL, temperature=0, max_output_tokens=40,
                                  input="Name a city in France, as JSON.", text_format=City)
    assert isinstance(parsed.output_parsed, City)


def test_structured_outputs_extra(smol: openai.OpenAI) -> None:
    response = smol.responses.create(model=MODEL, temperature=0, max_output_tokens=5,
                                     input="Yes or no?",
                                     extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert response.output_text in ("yes", "no")


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "name": "get_time"}], ids=["required", "named"]
)
def test_constrained_tool_calls_are_function_call_items(smol: openai.OpenAI, tool_choice: Any) -> None:
    fields: dict[str, Any] = dict(model=MODEL, temperature=0, max_output_tokens=60, tools=TOOLS,
                                  tool_choice=tool_choice, input="What is the weather in Paris?")
    response = smol.responses.create(**fields)
    assert response.status == "completed"
    calls = response.output  # no message: the answer is the calls (required: 1 or more)
    assert calls and (len(calls) == 1 or tool_choice == "required")
    parameters = {t["name"]: t["parameters"] for t in TOOLS}
    for call in calls:
        assert call.type == "function_call" and call.status == "completed"
        assert call.id.startswith("fc_") and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), parameters[call.name])
        if isinstance(tool_choice, dict):
            assert call.name == "get_time"
    events = list(smol.responses.create(**fields, stream=True))
    done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert done == [call.arguments for call in calls]
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    for index, call in enumerate(calls):
        mine = [e.delta for e in deltas if e.output_index == index]
        assert "".join(mine) == call.arguments
    streamed = events[-1].response.output
    assert [(s.name, s.arguments) for s in streamed] == [(c.name, c.arguments) for c in calls]
    assert events[-1].type == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
