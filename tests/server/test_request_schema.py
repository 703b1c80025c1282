"""Every field of OpenAI's and vLLM's request schemas is implemented or refused by name.

OpenAI's fields come from the installed ``openai`` package's request TypedDicts; vLLM's
are written down below from vLLM 0.32.0's protocol
(``vllm/entrypoints/openai/completion/protocol.py`` ``CompletionRequest`` and
``chat_completion/protocol.py`` ``ChatCompletionRequest``).
Each field must have a row in ``request_fields.py``; then the server must answer 200 for
an implemented field, and for a refused one a 400 naming it when set (while its neutral
value still gets a 200).
"""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from server_harness import API_KEY, ServerProcess

from inflight.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from inflight.entrypoints.openai.request_fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    Implemented,
    Refused,
    log_unknown_fields,
)

AUTH = {"Authorization": f"Bearer {API_KEY}"}

_VLLM_SHARED = """
    model frequency_penalty logit_bias logprobs max_tokens n presence_penalty seed stop
    stream stream_options temperature top_p user response_format use_beam_search top_k min_p
    repetition_penalty watermarking length_penalty stop_token_ids include_stop_str_in_output
    ignore_eos min_tokens skip_special_tokens spaces_between_special_tokens
    truncate_prompt_tokens truncation_side allowed_token_ids prompt_logprobs
    logprob_token_ids bad_words add_special_tokens structured_outputs priority request_id
    session_id return_tokens_as_token_ids return_token_ids routed_experts_prompt_start
    return_token_offsets return_mm_kwargs mm_payload cache_salt kv_transfer_params
    ec_transfer_params vllm_xargs repetition_detection stream_interval
""".split()
VLLM_COMPLETION_FIELDS = (
    _VLLM_SHARED
    + """
    prompt echo suffix prompt_embeds thinking_token_budget
""".split()
)
VLLM_CHAT_FIELDS = (
    _VLLM_SHARED
    + """
    messages top_logprobs max_completion_tokens tools tool_choice reasoning_effort
    thinking_token_budget include_reasoning parallel_tool_calls echo add_generation_prompt
    continue_final_message documents chat_template chat_template_kwargs media_io_kwargs
    mm_processor_kwargs return_prompt_text
""".split()
)

OPENAI_COMPLETION_FIELDS = set(completion_create_params.CompletionCreateParamsBase.__annotations__)
OPENAI_COMPLETION_FIELDS |= set(
    completion_create_params.CompletionCreateParamsStreaming.__annotations__
)
OPENAI_CHAT_FIELDS = set(chat_create_params.CompletionCreateParamsBase.__annotations__)
OPENAI_CHAT_FIELDS |= set(chat_create_params.CompletionCreateParamsStreaming.__annotations__)

COMPLETION = {"model": "tiny", "prompt": "w3 w4", "max_tokens": 2, "temperature": 0}
CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "w3 w4"}],
    "max_tokens": 2,
    "temperature": 0,
}
STREAM = {"stream": True}

# What each implemented field is tried with (a body patch: some need a companion field).
IMPLEMENTED_SHARED: dict[str, dict[str, Any]] = {
    "model": {"model": ""},
    "max_tokens": {"max_tokens": 3},
    "temperature": {"temperature": 0.7, "seed": 1},
    "top_p": {"top_p": 0.9},
    "stream": STREAM,
    "stream_options": {**STREAM, "stream_options": {"include_usage": True}},
    "stop": {"stop": ["w9"]},
    "seed": {"seed": 7, "temperature": 1.0},
    "user": {"user": "user-1"},
    "top_k": {"top_k": 5},
    "min_p": {"min_p": 0.1},
    "min_tokens": {"min_tokens": 1},
    "ignore_eos": {"ignore_eos": True},
    "stop_token_ids": {"stop_token_ids": [9]},
    "include_stop_str_in_output": {"include_stop_str_in_output": True},
    "skip_special_tokens": {"skip_special_tokens": False},
    # vLLM 0.32 answers false alike (the offline API already took it)
    "spaces_between_special_tokens": {
        "skip_special_tokens": False, "spaces_between_special_tokens": False,
    },
    "truncate_prompt_tokens": {"truncate_prompt_tokens": 1},
    "truncation_side": {"truncate_prompt_tokens": 1, "truncation_side": "right"},
    "priority": {"priority": 0},
    "request_id": {"request_id": "my-id"},
    "session_id": {"session_id": "session-1"},
    "return_token_ids": {"return_token_ids": True},
    "return_tokens_as_token_ids": {"return_tokens_as_token_ids": True},
    "return_token_offsets": {"return_token_offsets": True},
    "return_mm_kwargs": {"return_mm_kwargs": False},
    "mm_payload": {"mm_payload": "none"},
    "cache_salt": {"cache_salt": "salt"},
    "request_timeout": {"request_timeout": 600.0},  # inflight's extension
    "n": {"n": 2},
    "presence_penalty": {"presence_penalty": 0.5},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "logit_bias": {"logit_bias": {"5": 1.0}},
    "repetition_penalty": {"repetition_penalty": 1.2},
    "allowed_token_ids": {"allowed_token_ids": [3, 4]},
    "bad_words": {"bad_words": ["w3"]},
    "prompt_logprobs": {"prompt_logprobs": 1},
    "response_format": {"response_format": {"type": "text"}},
    "use_beam_search": {"use_beam_search": True, "n": 2},
    "length_penalty": {"use_beam_search": True, "length_penalty": 0.5},
}
# Constraints need a tokenizer llguidance can read, which the tiny model's word-level one is
# not: they are tried on the default model (tests/server/test_structured_server.py).
DEFAULT_MODEL_ONLY = {"structured_outputs"}
IMPLEMENTED_COMPLETION = IMPLEMENTED_SHARED | {
    "prompt": {"prompt": [3, 4]},
    "echo": {"echo": True},
    "add_special_tokens": {"add_special_tokens": False},
    "logprobs": {"logprobs": 1},
    "best_of": {"best_of": 2, "n": 2},
}
IMPLEMENTED_CHAT = IMPLEMENTED_SHARED | {
    "messages": {
        "messages": [{"role": "system", "content": "w5"}, {"role": "user", "content": "w3"}]
    },
    "max_completion_tokens": {"max_completion_tokens": 3},
    "parallel_tool_calls": {"parallel_tool_calls": False},
    "tools": {"tools": [{"type": "function", "function": {"name": "f"}}]},
    # required and named choices need a grammar: tried on the default model.
    "tool_choice": {
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "none",
    },
    "include_reasoning": {"include_reasoning": False},
    "metadata": {"metadata": {"k": "v"}},
    "store": {"store": True},
    "service_tier": {"service_tier": "auto"},
    "prompt_cache_key": {"prompt_cache_key": "key"},
    "prompt_cache_options": {"prompt_cache_options": {"ttl": "5m"}},
    "prompt_cache_retention": {"prompt_cache_retention": "24h"},
    "safety_identifier": {"safety_identifier": "user-1"},
    "echo": {"echo": True},
    "add_generation_prompt": {"add_generation_prompt": False},
    "continue_final_message": {
        "add_generation_prompt": False,
        "continue_final_message": True,
        "messages": [{"role": "user", "content": "w3"}, {"role": "assistant", "content": "w4"}],
    },
    "add_special_tokens": {"add_special_tokens": True},
    "documents": {"documents": [{"title": "t", "text": "w7"}]},
    "chat_template": {"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"},
    "chat_template_kwargs": {"chat_template_kwargs": {"enable_thinking": False}},
    "return_prompt_text": {"return_prompt_text": True},
    "logprobs": {"logprobs": True},
    "top_logprobs": {"logprobs": True, "top_logprobs": 2},
}

# Refused fields: (a value that must be refused, the neutral value that must still work).
REFUSED_SHARED: dict[str, tuple[Any, Any]] = {
    "watermarking": (True, False),
    "logprob_token_ids": ([3], None),
    "routed_experts_prompt_start": (1, 0),
    "kv_transfer_params": ({"do_remote_decode": True}, None),
    "ec_transfer_params": ({"x": 1}, None),
    "vllm_xargs": ({"x": 1}, None),
    "repetition_detection": ({"max_pattern_size": 4}, None),
    "thinking_token_budget": (10, None),
    "stream_interval": (2, 1),
}
REFUSED_COMPLETION = REFUSED_SHARED | {
    "suffix": ("w9", None),
    "prompt_embeds": ("AAAA", None),
}
REFUSED_CHAT = REFUSED_SHARED | {
    "functions": ([{"name": "f"}], None),
    "function_call": ({"name": "f"}, "none"),
    "reasoning_effort": ("low", "none"),
    "audio": ({"voice": "alloy", "format": "wav"}, None),
    "modalities": (["text", "audio"], ["text"]),
    "prediction": ({"type": "content", "content": "w3"}, None),
    "web_search_options": ({}, None),  # {} turns OpenAI's web search on
    "verbosity": ("low", "medium"),
    "moderation": ({"model": "omni-moderation-latest"}, None),
    "media_io_kwargs": ({"image": {"mode": "RGB"}}, None),
    "mm_processor_kwargs": ({"size": 1}, None),
}

ENDPOINTS = {
    "completions": (
        "/v1/completions",
        COMPLETION,
        COMPLETION_FIELDS,
        IMPLEMENTED_COMPLETION,
        REFUSED_COMPLETION,
    ),
    "chat": ("/v1/chat/completions", CHAT, CHAT_FIELDS, IMPLEMENTED_CHAT, REFUSED_CHAT),
}


@pytest.mark.parametrize(
    ("table", "model", "openai_fields", "vllm_fields"),
    [
        (COMPLETION_FIELDS, CompletionRequest, OPENAI_COMPLETION_FIELDS, VLLM_COMPLETION_FIELDS),
        (CHAT_FIELDS, ChatCompletionRequest, OPENAI_CHAT_FIELDS, VLLM_CHAT_FIELDS),
    ],
    ids=["completions", "chat"],
)
def test_every_schema_field_has_a_treatment(
    table: dict[str, Any], model: Any, openai_fields: set[str], vllm_fields: list[str]
) -> None:
    assert sorted(openai_fields - set(table)) == []
    assert sorted(set(vllm_fields) - set(table)) == []
    # The request model parses exactly the fields the table decides about.
    assert set(model.model_fields) == set(table)
    assert all(isinstance(t, (Implemented, Refused)) for t in table.values())


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_examples_cover_the_table(endpoint: str) -> None:
    _, _, table, implemented, refused = ENDPOINTS[endpoint]
    tried = set(implemented) | DEFAULT_MODEL_ONLY
    assert tried == {n for n, t in table.items() if isinstance(t, Implemented)}
    assert set(refused) == {n for n, t in table.items() if isinstance(t, Refused)}


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=60)


def _assert_ok(response: httpx.Response, stream: bool) -> None:
    assert response.status_code == 200, response.text
    if stream:
        assert response.text.rstrip().endswith("data: [DONE]"), response.text
    else:
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_implemented_fields_are_accepted(tiny_server: ServerProcess, endpoint: str) -> None:
    path, base, _, implemented, _ = ENDPOINTS[endpoint]
    for name, patch in implemented.items():
        response = _post(tiny_server, path, base | patch)
        assert response.status_code == 200, (name, response.text)
        _assert_ok(response, bool(patch.get("stream")))


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_refused_fields_are_named_unless_neutral(tiny_server: ServerProcess, endpoint: str) -> None:
    path, base, _, _, refused = ENDPOINTS[endpoint]
    for name, (value, neutral) in refused.items():
        response = _post(tiny_server, path, base | {name: value})
        assert response.status_code == 400, (name, response.text)
        error = response.json()["error"]
        assert error["param"] == name, error
        assert error["code"] == "unsupported_parameter" and name in error["message"], error
        _assert_ok(_post(tiny_server, path, base | {name: neutral}), False)


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_vllm_legacy_guided_fields_are_refused_by_name(
    tiny_server: ServerProcess, endpoint: str
) -> None:
    """vLLM before 0.12 took guided_*; ignoring them would give unconstrained output."""
    path, base, _, _, _ = ENDPOINTS[endpoint]
    for name, value in (("guided_choice", ["yes", "no"]), ("guided_json", {"type": "object"})):
        response = _post(tiny_server, path, base | {name: value})
        assert response.status_code == 400, (name, response.text)
        error = response.json()["error"]
        assert error["param"] == name and "structured_outputs" in error["message"], error


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_n_is_capped_as_in_openai(tiny_server: ServerProcess, endpoint: str) -> None:
    path, base, _, _, _ = ENDPOINTS[endpoint]
    response = _post(tiny_server, path, base | {"n": 100000})
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"
    _assert_ok(_post(tiny_server, path, base | {"n": 2}), False)


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_unknown_fields_are_ignored(tiny_server: ServerProcess, endpoint: str) -> None:
    path, base, _, _, _ = ENDPOINTS[endpoint]
    _assert_ok(_post(tiny_server, path, base | {"not_a_field_anywhere": {"x": 1}}), False)


@pytest.mark.parametrize(
    ("request_type", "base"),
    [(CompletionRequest, {"model": "m", "prompt": "hi"}),
     (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}]})],
)
def test_unknown_fields_are_named_in_a_warning(
    request_type: type, base: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Ignored, as vLLM does, but not silently: the server log names them."""
    request = request_type.model_validate(base | {"foo": 1, "bar_baz": [2]})
    with caplog.at_level(logging.WARNING, logger="inflight.entrypoints.openai.request_fields"):
        log_unknown_fields(request, "/v1/test")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("bar_baz" in m and "foo" in m and "ignored" in m for m in warnings), warnings


def test_unknown_fields_inside_stream_options_are_named_in_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A typo there (include_usuage) would otherwise go unnoticed: no usage chunk, no word."""
    body = {"model": "m", "prompt": "hi", "stream": True,
            "stream_options": {"include_usuage": True}}
    request = CompletionRequest.model_validate(body)
    with caplog.at_level(logging.WARNING, logger="inflight.entrypoints.openai.request_fields"):
        log_unknown_fields(request, "/v1/test")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("stream_options.include_usuage" in m for m in warnings), warnings


def test_chat_echo_and_continue_are_not_ignored(tiny_server: ServerProcess) -> None:
    """The two fields the issue found silently ignored change the answer."""
    messages = [{"role": "user", "content": "w3"}, {"role": "assistant", "content": "w4 w5"}]
    body = CHAT | {"messages": messages, "add_generation_prompt": False, "max_tokens": 4}
    plain = _post(tiny_server, "/v1/chat/completions", body).json()
    echoed = _post(tiny_server, "/v1/chat/completions", body | {"echo": True}).json()
    # vLLM: the answer's role is the final message's when no generation prompt is added,
    # and echo prepends that message's content.
    assert echoed["choices"][0]["message"]["role"] == "assistant"
    text = plain["choices"][0]["message"]["content"]
    assert echoed["choices"][0]["message"]["content"] == "w4 w5" + text
    both = body | {"continue_final_message": True, "add_generation_prompt": True}
    response = _post(tiny_server, "/v1/chat/completions", both)
    assert response.status_code == 400
    assert "continue_final_message" in response.json()["error"]["message"]


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_render_only_fields_are_typed_and_nullable(
    tiny_server: ServerProcess, endpoint: str
) -> None:
    """vLLM 0.32's mm_payload is a literal (not ignored when mistyped); its deprecated alias
    return_mm_kwargs may be null, as in vLLM."""
    path, base, _, _, _ = ENDPOINTS[endpoint]
    response = _post(tiny_server, path, base | {"mm_payload": 5})
    assert response.status_code == 400 and response.json()["error"]["param"] == "mm_payload"
    _assert_ok(_post(tiny_server, path, base | {"return_mm_kwargs": None}), False)


def test_chat_echo_answers_the_prompt_logprobs(tiny_server: ServerProcess) -> None:
    """vLLM's chat: echo asks for the prompt's logprobs (top_logprobs of them) and answers
    them in prompt_logprobs, as an explicit prompt_logprobs would."""
    body = CHAT | {"echo": True}
    echoed = _post(tiny_server, "/v1/chat/completions", body).json()
    explicit = _post(tiny_server, "/v1/chat/completions", CHAT | {"prompt_logprobs": 0}).json()
    assert echoed["prompt_logprobs"] == explicit["prompt_logprobs"]
    prompt_logprobs = echoed["prompt_logprobs"]
    assert prompt_logprobs[0] is None
    assert len(prompt_logprobs) == echoed["usage"]["prompt_tokens"]
    top = _post(tiny_server, "/v1/chat/completions",
                body | {"logprobs": True, "top_logprobs": 2}).json()["prompt_logprobs"]
    assert all(len(position) >= 2 for position in top[1:]), top
    assert _post(tiny_server, "/v1/chat/completions", CHAT).json()["prompt_logprobs"] is None
