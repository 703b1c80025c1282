"""Chat messages in every form OpenAI's API allows: the renderer, LLM.chat and the server.

Expected prompts come from transformers' own ``apply_chat_template`` on the plain-string
form vLLM reduces each message to (text parts joined with "\\n", null content as "");
expected answers from the offline engine on the same prompt.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_harness import API_KEY, CHAT_TEMPLATE, ServerProcess
from transformers import AutoTokenizer

from inflight import LLM, SamplingParams
from inflight.entrypoints.chat_utils import ChatOptions, render_chat, resolve_content_format

AUTH = {"Authorization": f"Bearer {API_KEY}"}
# Shows every role and name, so a test sees what the template was given.
ROLE_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}{% if m.name %}:{{ m.name }}{% endif %}>"
    "{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
PARTS = [{"type": "text", "text": "w3 w4"}, {"type": "text", "text": "w5"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir))


def reference(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return str(
        tokenizer.apply_chat_template(
            messages, chat_template=ROLE_TEMPLATE, tokenize=False, **kwargs
        )
    )


def rendered(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return render_chat(
        tokenizer, messages, ChatOptions(chat_template=ROLE_TEMPLATE, **kwargs)
    ).prompt


def test_text_parts_are_joined_with_newlines(tokenizer: Any) -> None:
    ours = rendered(tokenizer, [{"role": "user", "content": PARTS}])
    expected = reference(
        tokenizer, [{"role": "user", "content": "w3 w4\nw5"}], add_generation_prompt=True
    )
    assert ours == expected


def test_message_forms(tokenizer: Any) -> None:
    messages = [
        {"role": "developer", "content": "w1"},
        {"role": "user", "content": "w2", "name": "ann"},
        {"role": "assistant", "content": None},
        {"role": "system", "content": "w6"},  # a system message mid-conversation
        {"role": "narrator", "content": "w7"},  # a custom role goes to the template as is
    ]
    expected = reference(
        tokenizer,
        [
            {"role": "system", "content": "w1"},  # the template knows no "developer"
            {"role": "user", "content": "w2", "name": "ann"},
            {"role": "assistant", "content": ""},
            {"role": "system", "content": "w6"},
            {"role": "narrator", "content": "w7"},
        ],
        add_generation_prompt=True,
    )
    assert rendered(tokenizer, messages) == expected
    # A template that knows "developer" gets it as is.
    knows = "{% for m in messages %}{% if m.role == 'developer' %}D{% endif %}{% endfor %}"
    prompt = render_chat(
        tokenizer, messages[:1], ChatOptions(chat_template=knows, add_generation_prompt=False)
    ).prompt
    assert prompt == "D"


@pytest.mark.parametrize(
    ("messages", "options", "words"),
    [
        ([{"role": "user", "content": None}], {}, ["null", "assistant"]),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            {},
            ["'image_url'"],
        ),
        (
            [{"role": "user", "content": "w3"}],
            {"add_generation_prompt": False, "continue_final_message": True},
            ["continue_final_message", "assistant"],
        ),
        (
            [{"role": "user", "content": "w3"}],
            {"chat_template": "{{ raise_exception('no') }}"},
            ["no"],
        ),
        ([], {}, ["non-empty"]),
    ],
)
def test_refused_forms(
    tokenizer: Any, messages: Any, options: dict[str, Any], words: list[str]
) -> None:
    options = {"chat_template": ROLE_TEMPLATE} | options
    with pytest.raises(ValueError) as raised:
        render_chat(tokenizer, messages, ChatOptions(**options))
    assert all(w in str(raised.value) for w in words), raised.value


def test_both_flags_refused() -> None:
    with pytest.raises(ValueError, match="continue_final_message"):
        ChatOptions(add_generation_prompt=True, continue_final_message=True)


def test_continue_final_message_leaves_the_turn_open(tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "w3"}, {"role": "assistant", "content": "w4 w5"}]
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}"
    ours = render_chat(
        tokenizer,
        messages,
        ChatOptions(
            chat_template=template, add_generation_prompt=False, continue_final_message=True
        ),
    )
    expected = tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, continue_final_message=True
    )
    assert ours.prompt == expected == "<user>w3</s><assistant>w4 w5"


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_llm_chat_takes_text_parts(offline: LLM) -> None:
    kwargs: dict[str, Any] = {"use_tqdm": False, "chat_template": CHAT_TEMPLATE}
    joined = offline.chat([{"role": "user", "content": "w3 w4\nw5"}], greedy(6), **kwargs)
    parts = offline.chat([{"role": "user", "content": PARTS}], greedy(6), **kwargs)
    assert parts[0].prompt_token_ids == joined[0].prompt_token_ids
    assert parts[0].outputs[0].token_ids == joined[0].outputs[0].token_ids


def test_llm_chat_continue_final_message(offline: LLM, tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "w3"}, {"role": "assistant", "content": "w4 w5"}]
    out = offline.chat(
        messages,
        greedy(5),
        use_tqdm=False,
        chat_template=CHAT_TEMPLATE,
        add_generation_prompt=False,
        continue_final_message=True,
    )[0]
    text = tokenizer.apply_chat_template(
        messages, chat_template=CHAT_TEMPLATE, tokenize=False, continue_final_message=True
    )
    expected_ids = tokenizer.encode(text, add_special_tokens=False)
    assert out.prompt_token_ids == expected_ids
    alone = offline.generate({"prompt_token_ids": expected_ids}, greedy(5), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    with pytest.raises(ValueError, match="continue_final_message"):
        offline.chat(messages, chat_template=CHAT_TEMPLATE, continue_final_message=True)


# ---------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def client(tiny_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key=API_KEY, max_retries=0)


def chat(client: openai.OpenAI, messages: Any, **extra: Any) -> Any:
    return client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True, **extra.pop("extra_body", {})},
        **extra,
    )


def test_server_message_forms_equal_offline(client: openai.OpenAI, offline: LLM) -> None:
    forms = [
        [{"role": "user", "content": PARTS}],
        [{"role": "developer", "content": "w9"}, {"role": "user", "content": "w3", "name": "ann"}],
        [
            {"role": "user", "content": "w3"},
            {"role": "assistant", "content": None},
            {"role": "system", "content": "w8"},
            {"role": "narrator", "content": "w4"},
        ],
    ]
    for messages in forms:
        expected = offline.chat(messages, greedy(6), use_tqdm=False, chat_template=CHAT_TEMPLATE)
        response = chat(client, messages)
        assert response.choices[0].message.content == expected[0].outputs[0].text, messages
        assert response.usage is not None
        assert response.usage.prompt_tokens == len(expected[0].prompt_token_ids)


def test_server_continue_final_message(client: openai.OpenAI, offline: LLM) -> None:
    messages = [{"role": "user", "content": "w3"}, {"role": "assistant", "content": "w4 w5"}]
    expected = offline.chat(
        messages,
        greedy(6),
        use_tqdm=False,
        chat_template=CHAT_TEMPLATE,
        add_generation_prompt=False,
        continue_final_message=True,
    )[0]
    response = chat(
        client,
        messages,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    assert response.choices[0].message.content == expected.outputs[0].text != ""
    assert response.usage is not None
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)


@pytest.mark.parametrize(
    ("messages", "extra", "words"),
    [
        (
            [{"role": "user", "content": "w3"}],
            {"add_generation_prompt": True, "continue_final_message": True},
            ["continue_final_message", "add_generation_prompt"],
        ),
        (
            [{"role": "user", "content": "w3"}],
            {"add_generation_prompt": False, "continue_final_message": True},
            ["assistant"],
        ),
        (
            [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": ""}}]}],
            {},
            ["'input_audio'"],
        ),
        ([{"role": "user", "content": None}], {}, ["null"]),
    ],
)
def test_server_refusals(
    tiny_server: ServerProcess, messages: Any, extra: dict[str, Any], words: list[str]
) -> None:
    body = {"model": "tiny", "messages": messages, "max_tokens": 2} | extra
    response = httpx.post(f"{tiny_server.url}/v1/chat/completions", json=body, headers=AUTH)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert all(w in message for w in words), message


def test_server_template_errors_are_400s(tiny_server: ServerProcess) -> None:
    template = "{% for m in messages %}{% if m.role == 'robot' %}{{ raise_exception('no robots') }}{% endif %}{% endfor %}"
    body = {
        "model": "tiny",
        "messages": [{"role": "robot", "content": "w3"}],
        "chat_template": template,
    }
    response = httpx.post(f"{tiny_server.url}/v1/chat/completions", json=body, headers=AUTH)
    assert response.status_code == 400 and "no robots" in response.json()["error"]["message"]


def test_server_response_fields(
    client: openai.OpenAI, offline: LLM, tiny_server: ServerProcess
) -> None:
    messages = [{"role": "user", "content": "w3 w4"}]
    expected = offline.chat(messages, greedy(6), use_tqdm=False, chat_template=CHAT_TEMPLATE)[0]
    body = {
        "model": "",  # the served model, as in vLLM
        "messages": messages,
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "return_prompt_text": True,
        "request_id": "abc",
    }
    answer = httpx.post(f"{tiny_server.url}/v1/chat/completions", json=body, headers=AUTH).json()
    assert answer["id"] == "chatcmpl-abc" and answer["model"] == "tiny"
    assert answer["prompt_token_ids"] == expected.prompt_token_ids
    assert answer["prompt_text"] == "w3 w4 "
    assert answer["prompt_logprobs"] is None and "kv_transfer_params" in answer
    choice = answer["choices"][0]
    assert choice["token_ids"] == list(expected.outputs[0].token_ids)
    assert choice["stop_reason"] is None and choice["logprobs"] is None
    # Without return_token_ids the fields are there, null.
    plain = httpx.post(
        f"{tiny_server.url}/v1/chat/completions",
        json=body | {"return_token_ids": False},
        headers=AUTH,
    ).json()
    assert plain["prompt_token_ids"] is None and plain["choices"][0]["token_ids"] is None


def test_server_continuous_usage_stats(tiny_server: ServerProcess) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "w3 w4"}],
        "max_tokens": 5,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"continuous_usage_stats": True},
    }

    def chunks_of(body: dict[str, Any]) -> list[dict[str, Any]]:
        with httpx.stream(
            "POST", f"{tiny_server.url}/v1/chat/completions", json=body, headers=AUTH
        ) as response:
            lines = [ln for ln in response.iter_lines() if ln.startswith("data: {")]
        return [json.loads(ln.removeprefix("data: ")) for ln in lines]

    # vLLM's rule: continuous_usage_stats only counts together with include_usage.
    assert all(c.get("usage") is None for c in chunks_of(body))
    body["stream_options"] = {"continuous_usage_stats": True, "include_usage": True}
    chunks = chunks_of(body)
    assert all(c["usage"] is not None for c in chunks)
    token_chunks = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert [c["usage"]["completion_tokens"] for c in token_chunks] == [1, 2, 3, 4, 5]
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {2}
    # With n=2, each chunk counts its own choice's tokens (vLLM), the last chunk the sum.
    body["n"] = 2
    chunks = chunks_of(body)
    for index in (0, 1):
        mine = [c for c in chunks if c["choices"] and c["choices"][0]["index"] == index
                and c["choices"][0]["delta"].get("content")]
        assert [c["usage"]["completion_tokens"] for c in mine] == [1, 2, 3, 4, 5]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10


def test_a_request_template_needs_the_operator_s_trust(tiny_llama_dir: Path) -> None:
    """vLLM's rule: a template in the request is arbitrary Jinja on the server's one
    tokenizer thread (a long loop held every request), so it is a 400 unless the server
    runs with --trust-request-chat-template; the server's own template still serves."""
    from inprocess_server import InProcessServer

    server = InProcessServer(tiny_llama_dir, trust_request_chat_template=False).start()
    try:
        looping = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
        messages = [{"role": "user", "content": "w3 w4"}]
        for route, body in (
            ("/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 2,
                                      "chat_template": looping}),
            ("/tokenize", {"model": "tiny", "messages": messages, "chat_template": looping}),
        ):
            response = httpx.post(f"{server.url}{route}", json=body, timeout=30)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "chat_template"
            assert "--trust-request-chat-template" in error["message"]
        tokens = httpx.post(f"{server.url}/tokenize", timeout=30,
                            json={"model": "tiny", "prompt": "w3 w4"})
        assert tokens.status_code == 200  # the server is not held up
    finally:
        server.stop()


# ------------------------------------------------- vLLM's chat_template_content_format

# Loops over each message's content parts, as multimodal-ready templates do.
PARTS_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{% for p in m['content'] %}[{{ p.type }}:"
    "{{ p.text }}]{% endfor %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
OPENAI_PARTS = [{"type": "text", "text": "w3 w4"}, {"type": "text", "text": "w5"}]


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (ROLE_TEMPLATE, "string"),
        (CHAT_TEMPLATE, "string"),
        (PARTS_TEMPLATE, "openai"),
        ("{% for m in messages %}{% for p in m.content | selectattr('type', 'equalto', "
         "'text') %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
        ("{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}"
         "{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}{% endfor %}", "openai"),
        ("{% for m in messages %}{{ m.content ", "string"),  # unparsable: rendering says so
    ],
)
def test_auto_content_format_follows_the_template(template: str, expected: str) -> None:
    assert resolve_content_format(template) == expected
    assert resolve_content_format(template, "string") == "string"
    assert resolve_content_format(template, "openai") == "openai"


def test_a_template_that_loops_over_parts_gets_parts(tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "w9"},
        {"role": "user", "content": OPENAI_PARTS},
        {"role": "assistant", "content": None},
    ]
    ours = render_chat(tokenizer, messages, ChatOptions(chat_template=PARTS_TEMPLATE)).prompt
    as_parts = [
        {"role": "system", "content": [{"type": "text", "text": "w9"}]},
        {"role": "user", "content": OPENAI_PARTS},
        {"role": "assistant", "content": []},
    ]
    expected = tokenizer.apply_chat_template(
        as_parts, chat_template=PARTS_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert ours == expected == "<system>[text:w9]<user>[text:w3 w4][text:w5]<assistant><assistant>"
    # Forced to "string", the same template iterates over the joined text's characters.
    forced = render_chat(
        tokenizer, messages[:2], ChatOptions(chat_template=PARTS_TEMPLATE, content_format="string")
    ).prompt
    assert forced == "<system>[:][:]<user>" + "[:]" * len("w3 w4\nw5") + "<assistant>"
    with pytest.raises(ValueError, match="chat_template_content_format"):
        ChatOptions(content_format="markdown")


def test_llm_chat_content_format(offline: LLM, tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "w3 w4"}]
    expected = tokenizer.encode(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "text", "text": "w3 w4"}]}],
            chat_template=PARTS_TEMPLATE, tokenize=False, add_generation_prompt=True,
        ),
        add_special_tokens=False,
    )
    for content_format in ("auto", "openai"):
        out = offline.chat(messages, greedy(2), use_tqdm=False, chat_template=PARTS_TEMPLATE,
                           chat_template_content_format=content_format)[0]
        assert out.prompt_token_ids == expected
    with pytest.raises(ValueError, match="chat_template_content_format"):
        offline.chat(messages, greedy(2), use_tqdm=False, chat_template_content_format="x")


def test_server_renders_parts_for_a_parts_template(
    tiny_server: ServerProcess, tokenizer: Any
) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": OPENAI_PARTS}],
            "chat_template": PARTS_TEMPLATE}
    response = httpx.post(f"{tiny_server.url}/tokenize", json=body, headers=AUTH)
    assert response.status_code == 200, response.text
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": OPENAI_PARTS}], chat_template=PARTS_TEMPLATE,
        tokenize=False, add_generation_prompt=True,
    )
    assert response.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False)


def test_server_content_format_option(tiny_llama_dir: Path) -> None:
    """--chat-template-content-format openai gives even a template without a content loop
    the parts list ("auto" would give it a string)."""
    from inprocess_server import InProcessServer

    kind = "{% for m in messages %}{% if m.content is string %}w3{% else %}w4{% endif %}{% endfor %}"
    assert resolve_content_format(kind) == "string"
    server = InProcessServer(tiny_llama_dir, chat_template_content_format="openai").start()
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "w5"}],
                "chat_template": kind}
        response = httpx.post(f"{server.url}/tokenize", json=body, timeout=30)
        assert response.status_code == 200, response.text
        tokenizer = server.async_engine.tokenizer
        assert response.json()["tokens"] == tokenizer.encode("w4", add_special_tokens=False)
    finally:
        server.stop()
