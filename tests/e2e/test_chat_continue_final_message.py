"""The issue's continue_final_message example on the default model (SmolLM2-135M-Instruct).

The reference prompt is transformers' own rendering of the same messages with
``continue_final_message=True``; the continuation must be non-empty and equal
``LLM.generate`` on those ids (the server's side: tests/server/test_chat_default_model.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from inflight import LLM, SamplingParams
from inflight.model.loader import default_model_path

MESSAGES = [
    {"role": "user", "content": "Count to five, comma separated."},
    {"role": "assistant", "content": "1, 2, 3,"},
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def reference_ids() -> list[int]:
    from transformers import AutoTokenizer

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )
    text = tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert text.endswith("<|im_start|>assistant\n1, 2, 3,")
    return list(tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    yield LLM(max_num_seqs=4)


def test_offline_continue_final_message(llm: LLM, reference_ids: list[int]) -> None:
    out = llm.chat(
        MESSAGES, PARAMS, use_tqdm=False, add_generation_prompt=False, continue_final_message=True
    )[0]
    assert out.prompt_token_ids == reference_ids
    alone = llm.generate({"prompt_token_ids": reference_ids}, PARAMS, use_tqdm=False)[0]
    assert out.outputs[0].text == alone.outputs[0].text
    assert out.outputs[0].text.strip(), "the continuation is empty"
    # Text parts render as the joined string (this used to raise TypeError).
    parts = [
        {"type": "text", "text": "Count to five,"},
        {"type": "text", "text": "comma separated."},
    ]
    joined = llm.chat(
        [{"role": "user", "content": "Count to five,\ncomma separated."}], PARAMS, use_tqdm=False
    )[0]
    as_parts = llm.chat([{"role": "user", "content": parts}], PARAMS, use_tqdm=False)[0]
    assert as_parts.prompt_token_ids == joined.prompt_token_ids
