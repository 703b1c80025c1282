"""``POST /tokenize``: vLLM's fields for prompts and chat messages.

Expected ids and token strings come from the model's own Hugging Face tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import API_KEY, CHAT_TEMPLATE, ServerProcess
from transformers import AutoTokenizer

MESSAGES = [{"role": "user", "content": "w3"}, {"role": "assistant", "content": "w4 w5"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def tokenize(server: ServerProcess, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/tokenize", json=body)


def test_token_strs(tiny_server: ServerProcess, tokenizer: Any) -> None:
    answer = tokenize(tiny_server, prompt="w3 w9", return_token_strs=True).json()
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(answer["tokens"])
    assert tokenize(tiny_server, prompt="w3 w9").json()["token_strs"] is None


def test_messages_with_special_tokens(tiny_server: ServerProcess, tokenizer: Any) -> None:
    text = tokenizer.apply_chat_template(
        MESSAGES[:1], chat_template=CHAT_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    # (Was a 500.) The ids must be the tokenizer's own for the rendered text.
    for add_special in (True, False):
        response = tokenize(tiny_server, messages=MESSAGES[:1], add_special_tokens=add_special)
        assert response.status_code == 200, response.text
        expected = tokenizer.encode(text, add_special_tokens=add_special)
        assert response.json()["tokens"] == expected


def test_continue_final_message(tiny_server: ServerProcess, tokenizer: Any) -> None:
    text = tokenizer.apply_chat_template(
        MESSAGES, chat_template=CHAT_TEMPLATE, tokenize=False, continue_final_message=True
    )
    answer = tokenize(
        tiny_server, messages=MESSAGES, add_generation_prompt=False, continue_final_message=True
    ).json()
    assert answer["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    both = tokenize(
        tiny_server, messages=MESSAGES, add_generation_prompt=True, continue_final_message=True
    )
    assert both.status_code == 400 and "continue_final_message" in both.text


def test_tools_count_as_the_chat_endpoint_counts_them(tiny_server: ServerProcess) -> None:
    """(Was refused.) Messages with tools tokenize to what a chat request with the same
    tools is charged as prompt tokens (the tools rendered into the prompt), more than
    without them; tools with a plain prompt, or malformed, are 400s naming tools."""
    tools = [{
        "type": "function",
        "function": {"name": "lookup", "description": "w7 w8",
                     "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
    }]
    with_tools = tokenize(tiny_server, messages=MESSAGES[:1], tools=tools)
    assert with_tools.status_code == 200, with_tools.text
    plain = tokenize(tiny_server, messages=MESSAGES[:1]).json()["count"]
    assert with_tools.json()["count"] > plain
    chat = httpx.post(
        f"{tiny_server.url}/v1/chat/completions",
        json={"model": "tiny", "messages": MESSAGES[:1], "tools": tools, "max_tokens": 1},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == with_tools.json()["count"]
    for body in ({"prompt": "w3", "tools": tools},
                 {"messages": MESSAGES[:1], "tools": [{"type": "function"}]}):
        response = tokenize(tiny_server, **body)
        assert response.status_code == 400 and response.json()["error"]["param"] == "tools"


def test_refused_and_model(tiny_server: ServerProcess) -> None:
    response = tokenize(tiny_server, messages=MESSAGES[:1], mm_processor_kwargs={"size": 1})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "mm_processor_kwargs"
    assert tokenize(tiny_server, prompt="w3", model="").status_code == 200
    assert tokenize(tiny_server, prompt="w3", model="nope").status_code == 404


# vLLM 0.32.0's TokenizeCompletionRequest and TokenizeChatRequest, and DetokenizeRequest
# (vllm/entrypoints/serve/tokenize/protocol.py).
VLLM_TOKENIZE_FIELDS = """
    model prompt add_special_tokens return_token_strs messages add_generation_prompt
    continue_final_message chat_template chat_template_kwargs media_io_kwargs
    mm_processor_kwargs tools
""".split()
VLLM_DETOKENIZE_FIELDS = ["model", "tokens"]


def test_every_vllm_field_is_declared() -> None:
    from inflight.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
    from inflight.entrypoints.openai.request_fields import TOKENIZE_FIELDS

    assert sorted(set(VLLM_TOKENIZE_FIELDS) - set(TOKENIZE_FIELDS)) == []
    assert set(TokenizeRequest.model_fields) == set(TOKENIZE_FIELDS)
    assert set(DetokenizeRequest.model_fields) == set(VLLM_DETOKENIZE_FIELDS)


@pytest.mark.parametrize(
    ("name", "value"),
    [("chat_template", "{{ messages }}"), ("chat_template_kwargs", {"x": 1}),
     ("documents", [{"title": "t", "text": "w7"}]), ("add_generation_prompt", False),
     ("continue_final_message", True)],
)
def test_chat_only_fields_with_a_prompt_are_refused(
    tiny_server: ServerProcess, name: str, value: Any
) -> None:
    """They shape how messages render: with a prompt they would be ignored."""
    response = tokenize(tiny_server, prompt="w3", **{name: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == name and name in error["message"], error
    # Their defaults still go with a prompt (a client may send every field).
    default = {"add_generation_prompt": True, "continue_final_message": False}.get(name)
    assert tokenize(tiny_server, prompt="w3", **{name: default}).status_code == 200


def test_detokenize_names_unknown_fields_in_the_log(tiny_server: ServerProcess) -> None:
    """Ignored, as on every route, but not silently."""
    response = httpx.post(f"{tiny_server.url}/detokenize", json={"tokens": [3], "tokenz": [4]})
    assert response.status_code == 200, response.text
    assert "/detokenize" in tiny_server.log() and "tokenz" in tiny_server.log()
