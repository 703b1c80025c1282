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
