"""``POST /tokenize``: vLLM's fields for prompts and chat messages.

Expected ids and token strings come from the model's own Hugging Face tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import CHAT_TEMPLATE, ServerProcess
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


def test_refused_and_model(tiny_server: ServerProcess) -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    response = tokenize(tiny_server, messages=MESSAGES[:1], tools=tools)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"
    assert tokenize(tiny_server, prompt="w3", model="").status_code == 200
    assert tokenize(tiny_server, prompt="w3", model="nope").status_code == 404
