"""The issue's continue_final_message example through the server, on the default model.

The reference: transformers' rendering of the messages with ``continue_final_message=True``,
and the offline engine's greedy continuation of those ids.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import openai
import pytest
from server_harness import ServerProcess

from inflight import LLM, SamplingParams
from inflight.model.loader import default_model_path

MESSAGES = [
    {"role": "user", "content": "Count to five, comma separated."},
    {"role": "assistant", "content": "1, 2, 3,"},
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8)


def reference_ids() -> list[int]:
    from transformers import AutoTokenizer

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )
    text = tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module")
def client(start_server: Callable[..., ServerProcess]) -> openai.OpenAI:
    server = start_server("--max-num-seqs", "4")
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_server_continue_final_message(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    ids = reference_ids()
    expected = LLM(max_num_seqs=4).generate({"prompt_token_ids": ids}, PARAMS, use_tqdm=False)[0]
    assert response.choices[0].message.content == expected.outputs[0].text != ""
    assert response.usage is not None and response.usage.prompt_tokens == len(ids)


def test_logprob_bytes_join_into_characters_split_over_tokens(client: openai.OpenAI) -> None:
    """OpenAI's logprob ``bytes`` are each token's own UTF-8 bytes, so joined they give
    the text even where a character spans tokens (each such token's text alone is
    U+FFFD; its bytes were U+FFFD's). The answer is forced to emoji and CJK by a choice."""
    answer = "\U0001F600\U0001F603 ok \u65e5\u672c"
    response = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Say it."}],
        max_tokens=20,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"structured_outputs": {"choice": [answer]}},
    )
    choice = response.choices[0]
    assert choice.message.content == answer
    assert choice.logprobs is not None and choice.logprobs.content is not None
    # The complete choice is followed by the EOS it forces, which has its entry as in any
    # answer that ended with EOS (vLLM's too); the text leaves it out.
    *content, eos = choice.logprobs.content
    assert eos.token == "<|im_end|>"
    assert any(entry.token == "\ufffd" for entry in content)  # split characters
    assert b"".join(bytes(entry.bytes or []) for entry in content).decode() == answer
    for entry in content:
        best = entry.top_logprobs[0]
        if best.token == entry.token and "\ufffd" not in entry.token:
            assert best.bytes == entry.bytes == list(entry.token.encode())
