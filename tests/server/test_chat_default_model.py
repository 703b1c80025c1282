"""The issue's continue_final_message example through the server, on the default model.

The reference: transformers' rendering of the messages with ``continue_final_message=True``,
and the offline engine's greedy continuation of those ids.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import openai
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


def test_server_continue_final_message(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server("--max-num-seqs", "4")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
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
