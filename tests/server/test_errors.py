"""Every bad request gets OpenAI's error object and the right 4xx, and serving goes on."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import openai
import pytest
from server_harness import API_KEY, ServerProcess

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def assert_openai_error(
    response: httpx.Response, status: int, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def post(server: ServerProcess, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    headers = kwargs.pop("headers", AUTH)
    if isinstance(body, (str, bytes)):
        return httpx.post(f"{server.url}{path}", content=body, headers=headers, **kwargs)
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, **kwargs)


def ok_completion(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "w3 w4", "max_tokens": 4, "temperature": 0} | extra


@pytest.mark.parametrize("body", ["{not json", "", "[1, 2]", '"a string"'])
def test_invalid_json(tiny_server: ServerProcess, body: str) -> None:
    assert_openai_error(post(tiny_server, "/v1/completions", body), 400)


def test_unknown_model(tiny_server: ServerProcess) -> None:
    for path, body in (
        ("/v1/completions", ok_completion(model="gpt-4")),
        (
            "/v1/chat/completions",
            {"model": "gpt-4", "messages": [{"role": "user", "content": "w3"}]},
        ),
    ):
        assert_openai_error(post(tiny_server, path, body), 404, "model", "model_not_found")
    response = httpx.get(f"{tiny_server.url}/v1/models/gpt-4", headers=AUTH)
    assert_openai_error(response, 404, "model", "model_not_found")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", "8"),
        ("max_tokens", 2.5),
        ("temperature", "hot"),
        ("prompt", 5),
        ("prompt", [1, "w3"]),
        ("stream", "yes"),
        ("stop", 7),
        ("seed", True),
        ("priority", "high"),
        ("stop_token_ids", ["2"]),
    ],
)
def test_wrong_types(tiny_server: ServerProcess, field: str, value: Any) -> None:
    response = post(tiny_server, "/v1/completions", ok_completion(**{field: value}))
    assert_openai_error(response, 400, field, "invalid_type")


def test_wrong_types_in_chat(tiny_server: ServerProcess) -> None:
    # Any role *string* is passed to the template (tests/server/test_chat_messages.py).
    for messages in ("hi", [{"role": 5, "content": "w3"}], []):
        body = {"model": "tiny", "messages": messages}
        assert_openai_error(post(tiny_server, "/v1/chat/completions", body), 400, "messages")
    # A missing role is named by its path (test_missing_nested_field_is_named_by_its_path).
    body = {"model": "tiny", "messages": [{"content": "w3"}]}
    assert_openai_error(post(tiny_server, "/v1/chat/completions", body), 400, "messages[0].role")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 2.5),
        ("temperature", -1),
        ("top_p", 0),
        ("top_p", 1.5),
        ("max_tokens", 0),
        ("top_k", -2),
        ("min_p", 1.5),
        ("presence_penalty", 3),
        ("n", 0),
    ],
)
def test_out_of_range(tiny_server: ServerProcess, field: str, value: Any) -> None:
    response = post(tiny_server, "/v1/completions", ok_completion(**{field: value}))
    assert_openai_error(response, 400, field, "invalid_value")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"best_of": 3}, "best_of"),  # n completions are all returned: best_of must be n
        ({"logprobs": 1, "echo": True, "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
        ({"min_tokens": 9}, "min_tokens"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": [600]}, "prompt"),
    ],
)
def test_unsupported_or_inconsistent(
    tiny_server: ServerProcess, extra: dict[str, Any], param: str
) -> None:
    response = post(tiny_server, "/v1/completions", ok_completion(**extra))
    assert_openai_error(response, 400, param)


def test_missing_required_field(tiny_server: ServerProcess) -> None:
    response = post(tiny_server, "/v1/completions", {"model": "tiny"})
    assert_openai_error(response, 400, "prompt", "missing_required_parameter")


def test_missing_nested_field_is_named_by_its_path(tiny_server: ServerProcess) -> None:
    # OpenAI names the missing field itself, not the list that holds it.
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}, {"content": "x"}]}
    response = post(tiny_server, "/v1/chat/completions", body)
    error = assert_openai_error(response, 400, "messages[1].role", "missing_required_parameter")
    assert "'messages[1].role'" in error["message"]


def test_prompt_over_max_model_len(tiny_server: ServerProcess) -> None:
    long_prompt = [5] * 600  # the tiny model's context is 512 tokens
    response = post(tiny_server, "/v1/completions", ok_completion(prompt=long_prompt))
    error = assert_openai_error(response, 400, "prompt", "context_length_exceeded")
    assert "512" in error["message"]
    # A prompt that fills the context leaves no room for a token, even with max_tokens 0.
    for max_tokens in (1, 0):
        response = post(tiny_server, "/v1/completions",
                        ok_completion(prompt=[5] * 512, max_tokens=max_tokens, echo=True))
        assert_openai_error(response, 400, "prompt", "context_length_exceeded")
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "w5 " * 600}]}
    response = post(tiny_server, "/v1/chat/completions", chat)
    assert_openai_error(response, 400, "messages", "context_length_exceeded")


def test_max_tokens_past_the_context_is_cut_to_the_room_left(tiny_server: ServerProcess) -> None:
    """vLLM 0.32 clamps max_tokens to what the context leaves, on every route (found by
    vllm_diff_server.py; older vLLM and OpenAI answer a 400)."""
    body = ok_completion(prompt=[5] * 500, max_tokens=100, ignore_eos=True)
    choice, usage = (lambda r: (r["choices"][0], r["usage"]))(
        post(tiny_server, "/v1/completions", body).json())
    assert (choice["finish_reason"], usage["completion_tokens"]) == ("length", 12)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "w5 " * 480}],
            "max_completion_tokens": 100, "ignore_eos": True, "temperature": 0}
    answer = post(tiny_server, "/v1/chat/completions", chat).json()
    room = 512 - answer["usage"]["prompt_tokens"]
    assert 0 < room < 100 and answer["usage"]["completion_tokens"] == room
    assert answer["choices"][0]["finish_reason"] == "length"


def test_bad_chat_template(tiny_server: ServerProcess) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "w3"}],
        "chat_template": "{% for m in messages %}{{ m.content ",
    }
    assert_openai_error(post(tiny_server, "/v1/chat/completions", body), 400, "messages")


def test_api_key(tiny_server: ServerProcess) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path in (
            ("POST", "/v1/completions"),
            ("POST", "/v1/chat/completions"),
            ("GET", "/v1/models"),
        ):
            response = httpx.request(
                method, f"{tiny_server.url}{path}", headers=headers, json=ok_completion()
            )
            assert_openai_error(response, 401, code="invalid_api_key")
    # Only /v1 is protected: probes and scrapers need no key.
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(f"{tiny_server.url}{path}").status_code == 200
    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as raised:
        client.models.list()
    assert raised.value.status_code == 401


def test_openai_client_sees_bad_request(tiny_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="tiny", prompt="w3", temperature=5)
    assert raised.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="w3")


def test_unknown_route_and_method(tiny_server: ServerProcess) -> None:
    assert_openai_error(httpx.get(f"{tiny_server.url}/v1/nothing", headers=AUTH), 404)
    assert_openai_error(httpx.get(f"{tiny_server.url}/v1/completions", headers=AUTH), 405)


def test_errors_do_not_disturb_other_requests(tiny_server: ServerProcess) -> None:
    """A stream in flight completes while bad requests are rejected beside it."""
    received: list[str] = []

    def stream() -> None:
        body = ok_completion(max_tokens=200, stream=True, ignore_eos=True)
        with httpx.stream(
            "POST", f"{tiny_server.url}/v1/completions", json=body, headers=AUTH, timeout=60
        ) as response:
            received.extend(line for line in response.iter_lines() if line.startswith("data:"))

    worker = threading.Thread(target=stream)
    worker.start()
    for _ in range(5):
        assert_openai_error(post(tiny_server, "/v1/completions", "{bad"), 400)
        assert_openai_error(
            post(tiny_server, "/v1/completions", ok_completion(prompt=[9999])), 400, "prompt"
        )
        assert_openai_error(post(tiny_server, "/v1/completions", ok_completion(top_p=7)), 400)
    worker.join(60)
    assert received[-1] == "data: [DONE]"
    assert len(received) == 201  # 200 token chunks, then [DONE]
    response = post(tiny_server, "/v1/completions", ok_completion())
    assert response.status_code == 200 and response.json()["choices"][0]["text"]


def test_vllm_wording_for_prompts(tiny_server: ServerProcess) -> None:
    """Clients match on vLLM's messages: out-of-vocabulary ids, empty prompts, overflow."""
    error = assert_openai_error(
        post(tiny_server, "/v1/completions", ok_completion(prompt=[3, 600, 4])), 400, "prompt"
    )
    assert error["message"].startswith("Token id 600 is out of vocabulary")
    assert "512" in error["message"]  # the tiny model's vocabulary size
    # A negative id is out of vocabulary too, not a prompt of the wrong type.
    for prompt in ([3, -5, 4], [[3, 4], [-1]]):
        error = assert_openai_error(
            post(tiny_server, "/v1/completions", ok_completion(prompt=prompt)), 400, "prompt"
        )
        assert error["message"].startswith("Token id -"), error["message"]
        assert error["code"] == "invalid_value"
    for prompt in ("", []):
        error = assert_openai_error(
            post(tiny_server, "/v1/completions", ok_completion(prompt=prompt)), 400, "prompt"
        )
        assert error["message"] == "Either prompt or prompt_embeds must be provided and non-empty."
    error = assert_openai_error(
        post(tiny_server, "/v1/completions", ok_completion(prompt=[[]])), 400, "prompt"
    )
    assert error["message"] == "The decoder prompt cannot be empty"
    error = assert_openai_error(
        post(tiny_server, "/v1/completions", ok_completion(prompt=[5] * 513)),
        400,
        "prompt",
        "context_length_exceeded",
    )
    assert error["message"].startswith(
        "This model's maximum context length is 512 tokens. However, your prompt contains 513 "
        "input tokens, which exceeds this limit even without any output tokens."
    )


def test_truncate_prompt_tokens_makes_a_long_prompt_fit(tiny_server: ServerProcess) -> None:
    long_prompt = [7] * 100 + [5] * 600
    response = post(
        tiny_server,
        "/v1/completions",
        ok_completion(prompt=long_prompt, truncate_prompt_tokens=10, return_token_ids=True),
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["prompt_token_ids"] == [5] * 10  # the last 10
    assert response.json()["usage"]["prompt_tokens"] == 10


def test_dtype_float16_refused_at_start_up(tiny_llama_dir: Any) -> None:
    """``--dtype float16`` cannot run on the CPU kernels: refused before serving."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "inflight.entrypoints.cli", "serve", str(tiny_llama_dir),
         "--dtype", "float16", "--device", "cpu", "--port", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "float16" in done.stderr and "CUDA" in done.stderr
    from inflight import LLM

    with pytest.raises(ValueError, match="float16"):
        LLM(str(tiny_llama_dir), dtype="float16", device="cpu")


def test_priority_without_priority_scheduling_is_refused(tiny_server: ServerProcess) -> None:
    # vLLM's rule: the shared server schedules fcfs, where a priority would be ignored.
    for path, body in (
        ("/v1/completions", ok_completion(priority=3)),
        ("/v1/chat/completions",
         {"model": "tiny", "messages": [{"role": "user", "content": "w3"}], "priority": -1}),
    ):
        response = post(tiny_server, path, body)
        assert_openai_error(response, 400, "priority")
        assert "priority scheduling is not enabled" in response.json()["error"]["message"]
    assert post(tiny_server, "/v1/completions", ok_completion(priority=0)).status_code == 200


@pytest.mark.parametrize(
    "tool_calls",
    ["x", [5], [{"type": "function", "function": {}}],
     [{"type": "function", "function": {"name": 7, "arguments": "{}"}}],
     [{"type": "code", "function": {"name": "f", "arguments": "{}"}}],
     # arguments that are not JSON text (vLLM parses them before rendering: a 400)
     [{"type": "function", "function": {"name": "f", "arguments": "{oops"}}],
     [{"type": "function", "function": {"name": "f", "arguments": "  "}}]],
)
def test_malformed_assistant_tool_calls_are_refused(tiny_server: ServerProcess, tool_calls: Any) -> None:
    """OpenAI's shape for an earlier call: [{"id", "type": "function", "function": {"name",
    "arguments"}}]; anything else is a 400 naming the messages, not a prompt with null names."""
    messages = [{"role": "user", "content": "w3"}, {"role": "assistant", "tool_calls": tool_calls},
                {"role": "user", "content": "w4"}]
    response = post(tiny_server, "/v1/chat/completions",
                    {"model": "tiny", "messages": messages, "max_tokens": 2})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith("messages")


def test_empty_tool_call_arguments_are_an_empty_object(tiny_server: ServerProcess) -> None:
    """vLLM's reading of "" (or no arguments): {}."""
    call = {"type": "function", "function": {"name": "f", "arguments": ""}}
    messages = [{"role": "user", "content": "w3"}, {"role": "assistant", "tool_calls": [call]},
                {"role": "user", "content": "w4"}]
    response = post(tiny_server, "/v1/chat/completions",
                    {"model": "tiny", "messages": messages, "max_tokens": 2})
    assert response.status_code == 200, response.text
