"""The server through the official ``openai`` client: answers match the offline API."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from server_harness import API_KEY, CHAT_TEMPLATE, ServerProcess

from inflight import LLM, SamplingParams

PROMPTS = ["w3 w4 w5", "w10 w11 w12 w13 w14 w15"]


def greedy(max_tokens: int, **extra: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra)  # type: ignore[arg-type]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_equals_offline(client: openai.OpenAI, offline: LLM, prompt: str) -> None:
    expected = offline.generate(prompt, greedy(12), use_tqdm=False)[0]
    response = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    choice = response.choices[0]
    assert choice.text == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert response.object == "text_completion" and response.model == "tiny"
    assert response.usage is not None
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_streamed_completion_equals_offline(client: openai.OpenAI, offline: LLM) -> None:
    prompt = PROMPTS[1]
    expected = offline.generate(prompt, greedy(16, ignore_eos=True), use_tqdm=False)[0]
    stream = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    token_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in token_chunks) == expected.outputs[0].text
    assert len(token_chunks) == 16  # one chunk per generated token
    assert [c.choices[0].finish_reason for c in token_chunks] == [None] * 15 + ["length"]
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage is not None
    assert usage.completion_tokens == 16 and usage.prompt_tokens == len(expected.prompt_token_ids)


def test_token_id_prompt_and_prompt_list(client: openai.OpenAI, offline: LLM) -> None:
    ids = [3, 4, 5, 6]
    expected = offline.generate([{"prompt_token_ids": ids}, PROMPTS[0]], greedy(8), use_tqdm=False)
    single = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    assert single.choices[0].text == expected[0].outputs[0].text
    both = client.completions.create(
        model="tiny-alias", prompt=[ids, [3, 4, 5]], max_tokens=8, temperature=0
    )
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text == expected[0].outputs[0].text
    texts = client.completions.create(
        model="tiny", prompt=["w3 w4 w5", "w7 w8"], max_tokens=8, temperature=0, stream=True
    )
    joined = {0: "", 1: ""}
    for chunk in texts:
        joined[chunk.choices[0].index] += chunk.choices[0].text
    assert joined[0] == expected[1].outputs[0].text


def test_echo_and_stop_strings(client: openai.OpenAI, offline: LLM) -> None:
    prompt = PROMPTS[0]
    full = offline.generate(prompt, greedy(12, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    words = full.text.split()
    stop = f"{words[2]} {words[3]}"  # a stop string spanning two tokens
    expected = offline.generate(prompt, greedy(12, ignore_eos=True, stop=[stop]), use_tqdm=False)[
        0
    ].outputs[0]
    assert expected.finish_reason == "stop"
    plain = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stop=stop,
        extra_body={"ignore_eos": True},
    )
    assert plain.choices[0].text == expected.text
    streamed = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stop=[stop],
        stream=True,
        extra_body={"ignore_eos": True},
    )
    # Text that could begin the stop string is held back, so none of it leaks out.
    assert "".join(c.choices[0].text for c in streamed) == expected.text
    echoed = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=4, temperature=0, echo=True
    )
    assert echoed.choices[0].text.startswith(prompt)


def test_chat_equals_offline(client: openai.OpenAI, offline: LLM) -> None:
    messages = [{"role": "system", "content": "w20 w21"}, {"role": "user", "content": "w3 w4"}]
    expected = offline.chat(messages, greedy(10), use_tqdm=False, chat_template=CHAT_TEMPLATE)[
        0
    ].outputs[0]
    response = client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=10,
        temperature=0,
    )
    assert response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.text
    assert response.choices[0].finish_reason == expected.finish_reason
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == expected.text
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_32_concurrent_streams(tiny_server: ServerProcess) -> None:
    lengths = [8 + i % 9 for i in range(32)]

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int, str | None]:
        stream = await client.completions.create(
            model="tiny",
            prompt=f"w{3 + i} w{40 + i} w{90 + i}",
            max_tokens=lengths[i],
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks, usage, reason = 0, -1, None
        async for chunk in stream:
            if chunk.choices:
                chunks += 1
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        assert chunks == usage
        return chunks, usage, reason

    async def main() -> list[tuple[int, int, str | None]]:
        async with openai.AsyncOpenAI(
            base_url=f"{tiny_server.url}/v1", api_key=API_KEY, max_retries=0
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(main())
    assert [r[0] for r in results] == lengths
    assert all(r[2] == "length" for r in results)


def test_models_and_service_routes(client: openai.OpenAI, tiny_server: ServerProcess) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
    url = tiny_server.url
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/version").json()["version"]
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": "w3 w9"}).json()
    assert tokens["tokens"] == [3, 9] and tokens["count"] == 2 and tokens["max_model_len"] == 512
    chat_tokens = httpx.post(
        f"{url}/tokenize", json={"messages": [{"role": "user", "content": "w5 w6"}]}
    ).json()
    assert chat_tokens["tokens"] == [5, 6]
    assert httpx.post(f"{url}/detokenize", json={"tokens": [3, 9]}).json() == {"prompt": "w3 w9"}


def test_completion_token_ids_and_continuous_usage(
    client: openai.OpenAI, offline: LLM, tiny_server: ServerProcess
) -> None:
    expected = offline.generate(PROMPTS[0], greedy(5, ignore_eos=True), use_tqdm=False)[0]
    body = {
        "model": "tiny",
        "prompt": PROMPTS[0],
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    answer = httpx.post(f"{tiny_server.url}/v1/completions", json=body, headers=headers).json()
    choice = answer["choices"][0]
    assert choice["prompt_token_ids"] == expected.prompt_token_ids
    assert choice["token_ids"] == list(expected.outputs[0].token_ids)
    assert choice["prompt_logprobs"] is None and choice["stop_reason"] is None
    stream = client.completions.create(
        model="tiny",
        prompt=PROMPTS[0],
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    *chunks, last = list(stream)
    assert not last.choices and last.usage.completion_tokens == 5  # include_usage's chunk
    assert [c.usage.completion_tokens for c in chunks if c.usage] == [1, 2, 3, 4, 5]
    extras = [c.choices[0].model_extra or {} for c in chunks]
    assert extras[0]["prompt_token_ids"] == expected.prompt_token_ids
    assert [e["token_ids"] for e in extras] == [[t] for t in expected.outputs[0].token_ids]
    # Two prompts of different lengths: each chunk counts its own prompt and choice
    # (vLLM's continuous usage), the include_usage chunk the totals.
    second = offline.generate(PROMPTS[1], greedy(1), use_tqdm=False)[0]
    lengths = [len(expected.prompt_token_ids), len(second.prompt_token_ids)]
    assert lengths[0] != lengths[1]
    *chunks, last = list(client.completions.create(
        model="tiny", prompt=[PROMPTS[0], PROMPTS[1]], max_tokens=3, temperature=0,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        extra_body={"ignore_eos": True},
    ))
    for index in (0, 1):
        mine = [c.usage for c in chunks if c.choices[0].index == index]
        assert [(u.prompt_tokens, u.completion_tokens) for u in mine] == [
            (lengths[index], k) for k in (1, 2, 3)
        ]
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (sum(lengths), 6)
