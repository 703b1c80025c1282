"""Issue 12 over HTTP with the official ``openai`` client: n, penalties, logit_bias and
logprobs. Expected values come from the offline engine on the same prompt (itself checked
against transformers and hand-computed transforms in tests/engine), or from the API's
documented shapes; bad values must be 400s in OpenAI's error shape naming the field."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from server_harness import API_KEY, CHAT_TEMPLATE, ServerProcess

from inflight import LLM, SamplingParams

PROMPT = "w10 w11 w12 w13 w14 w15"
MESSAGES: list[Any] = [{"role": "user", "content": "w3 w4 w5"}]
VOCAB_SIZE = 512  # the tiny model's
TOL = 1e-4


def params(max_tokens: int, **extra: Any) -> SamplingParams:
    options: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True} | extra
    return SamplingParams(max_tokens=max_tokens, **options)


def token_ids_of(choice: Any) -> list[int]:
    return list((choice.model_extra or {})["token_ids"])


def test_completion_logprobs_equal_offline(client: openai.OpenAI, offline: LLM) -> None:
    expected = offline.generate(PROMPT, params(6, logprobs=5), use_tqdm=False)[0].outputs[0]
    response = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logprobs=5,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = response.choices[0]
    assert token_ids_of(choice) == expected.token_ids
    assert choice.logprobs is not None and expected.logprobs is not None
    logprobs = choice.logprobs
    assert logprobs.tokens is not None and logprobs.token_logprobs is not None
    assert logprobs.top_logprobs is not None and logprobs.text_offset is not None
    assert len(logprobs.tokens) == len(expected.token_ids) == 6
    for i, (token, position) in enumerate(zip(expected.token_ids, expected.logprobs, strict=True)):
        assert logprobs.token_logprobs[i] == pytest.approx(position[token].logprob, abs=TOL)
        top = logprobs.top_logprobs[i]
        # OpenAI: the 5 most likely tokens, plus the sampled one (greedy: among them).
        assert len(top) == 5
        assert logprobs.tokens[i] in top
        want = sorted((lp.logprob for lp in position.values()), reverse=True)
        assert sorted(top.values(), reverse=True) == pytest.approx(want, abs=TOL)
        # Greedy picks the most likely token.
        assert logprobs.token_logprobs[i] == pytest.approx(max(top.values()), abs=TOL)
    offsets = [0]
    for token in logprobs.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs.text_offset == offsets
    # The tokens' strings keep their leading spaces: together they are the text, so each
    # text_offset points at its token inside it.
    assert "".join(logprobs.tokens) == choice.text


def test_echo_with_max_tokens_zero_gives_prompt_logprobs(
    client: openai.OpenAI, offline: LLM
) -> None:
    expected = offline.generate(
        PROMPT, SamplingParams(prompt_logprobs=1, max_tokens=0), use_tqdm=False
    )[0]
    assert expected.prompt_logprobs is not None
    prompt_ids = expected.prompt_token_ids
    response = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1
    )
    choice = response.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert response.usage is not None and response.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert logprobs.top_logprobs is not None and logprobs.tokens is not None
    assert len(logprobs.tokens) == len(prompt_ids)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for i in range(1, len(prompt_ids)):
        position = expected.prompt_logprobs[i]
        assert position is not None
        assert logprobs.token_logprobs[i] == pytest.approx(position[prompt_ids[i]].logprob, abs=TOL)
        assert 1 <= len(logprobs.top_logprobs[i]) <= 2  # the prompt token and the top 1
    # With tokens generated too, the prompt's entries come first, then the new tokens'.
    both = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=1
    ).choices[0]
    assert both.logprobs is not None and both.logprobs.token_logprobs is not None
    assert len(both.logprobs.token_logprobs) == len(prompt_ids) + 3
    assert both.logprobs.token_logprobs[: len(prompt_ids)] == logprobs.token_logprobs
    # vLLM's prompt_logprobs field carries the same values, keyed by token id.
    vllm_field = (choice.model_extra or {})["prompt_logprobs"]
    assert vllm_field[0] is None
    assert vllm_field[1][str(prompt_ids[1])]["logprob"] == pytest.approx(
        logprobs.token_logprobs[1], abs=TOL
    )


def test_echo_with_max_tokens_zero_alone_carries_no_prompt_logprobs(
    client: openai.OpenAI,
) -> None:
    """(The engine computes the prompt's logprobs to prefill it, and they leaked into
    vLLM's prompt_logprobs field, asked for by neither prompt_logprobs nor logprobs.)"""
    choice = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=0, echo=True
    ).choices[0]
    assert choice.text == PROMPT and choice.logprobs is None
    assert (choice.model_extra or {})["prompt_logprobs"] is None


def test_chat_logprobs_and_top_logprobs(client: openai.OpenAI, offline: LLM) -> None:
    expected = offline.chat(
        MESSAGES, params(5, logprobs=3), use_tqdm=False, chat_template=CHAT_TEMPLATE
    )[0].outputs[0]
    assert expected.logprobs is not None
    response = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    choice = response.choices[0]
    assert choice.message.content == expected.text
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert len(content) == len(expected.token_ids)
    for entry, token, position in zip(content, expected.token_ids, expected.logprobs, strict=True):
        assert entry.logprob == pytest.approx(position[token].logprob, abs=TOL)
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy took the best
        assert entry.logprob == pytest.approx(values[0], abs=TOL)
    streamed = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    pieces = [
        e.logprob
        for chunk in streamed
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content
        for e in chunk.choices[0].logprobs.content
    ]
    assert pieces == pytest.approx([e.logprob for e in content], abs=TOL)


def test_return_tokens_as_token_ids_names_every_logprob_token_by_id(
    client: openai.OpenAI, offline: LLM
) -> None:
    """vLLM's return_tokens_as_token_ids: each logprob token and top-logprob key is
    "token_id:<id>" (the ids the offline engine sampled and ranked), streamed or not; the
    values do not change, and chat's bytes stay the token's own text's."""
    expected = offline.generate(PROMPT, params(4, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert expected.logprobs is not None
    labels = [f"token_id:{t}" for t in expected.token_ids]
    body: dict[str, Any] = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    for stream in (False, True):
        response = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3,
            stream=stream, extra_body=body,
        )
        chunks = list(response) if stream else [response]  # type: ignore[arg-type]
        tokens: list[str] = []
        tops: list[dict[str, float]] = []
        for chunk in chunks:
            for choice in chunk.choices:
                if choice.logprobs is not None:
                    tokens += choice.logprobs.tokens or []
                    tops += choice.logprobs.top_logprobs or []
        assert tokens == labels
        for top, position in zip(tops, expected.logprobs, strict=True):
            want = {f"token_id:{t}": lp.logprob for t, lp in position.items()}
            assert top == pytest.approx(want, abs=TOL)
    chat_expected = offline.chat(
        MESSAGES, params(4, logprobs=2), use_tqdm=False, chat_template=CHAT_TEMPLATE
    )[0].outputs[0]
    assert chat_expected.logprobs is not None
    chat = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=2, extra_body=body,
    ).choices[0]
    assert chat.logprobs is not None and chat.logprobs.content is not None
    content = chat.logprobs.content
    assert [e.token for e in content] == [f"token_id:{t}" for t in chat_expected.token_ids]
    assert b"".join(bytes(e.bytes or []) for e in content).decode() == chat_expected.text
    for entry, position in zip(content, chat_expected.logprobs, strict=True):
        ranked = sorted((lp.rank or 0, t) for t, lp in position.items() if lp.rank)
        assert [t.token for t in entry.top_logprobs] == [f"token_id:{t}" for _, t in ranked[:2]]


def test_n3_completions_match_offline_streamed_or_not(client: openai.OpenAI, offline: LLM) -> None:
    sampling = params(8, n=3, temperature=1.0, seed=123)
    expected = offline.generate(PROMPT, sampling, use_tqdm=False)[0]
    texts = [o.text for o in sorted(expected.outputs, key=lambda o: o.index)]
    assert len(set(texts)) > 1  # seeded children differ (seed + index)
    body: dict[str, Any] = {"ignore_eos": True}
    response = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, n=3, temperature=1.0, seed=123, extra_body=body
    )
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.text for c in response.choices] == texts
    assert response.usage is not None
    assert response.usage.completion_tokens == 24
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)  # counted once
    stream = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=8,
        n=3,
        temperature=1.0,
        seed=123,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=body,
    )
    joined = {0: "", 1: "", 2: ""}
    finishes: dict[int, list[str]] = {0: [], 1: [], 2: []}
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            joined[choice.index] += choice.text
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
    assert [joined[i] for i in range(3)] == texts
    assert finishes == {0: ["length"], 1: ["length"], 2: ["length"]}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24
    # Two prompts with n=2: choice i * n + j is completion j of prompt i (vLLM's numbering).
    two = client.completions.create(
        model="tiny", prompt=[PROMPT, "w3 w4"], max_tokens=4, n=2, temperature=0, extra_body=body
    )
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert two.choices[0].text == two.choices[1].text  # greedy children are identical


def test_n3_chat_streamed_or_not(client: openai.OpenAI, offline: LLM) -> None:
    sampling = params(6, n=3, temperature=1.0, seed=7)
    expected = offline.chat(MESSAGES, sampling, use_tqdm=False, chat_template=CHAT_TEMPLATE)[0]
    texts = [o.text for o in sorted(expected.outputs, key=lambda o: o.index)]
    body: dict[str, Any] = {"ignore_eos": True}
    response = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=6,
        n=3,
        temperature=1.0,
        seed=7,
        extra_body=body,
    )
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.message.content for c in response.choices] == texts
    assert response.usage is not None and response.usage.completion_tokens == 18
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=6,
        n=3,
        temperature=1.0,
        seed=7,
        stream=True,
        extra_body=body,
    )
    joined = {0: "", 1: "", 2: ""}
    roles: list[int] = []
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.index)
            joined[choice.index] += choice.delta.content or ""
    assert sorted(roles) == [0, 1, 2]
    assert [joined[i] for i in range(3)] == texts


@pytest.mark.parametrize(
    "penalty", [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 1.8}]
)
def test_penalties_equal_offline(
    client: openai.OpenAI, offline: LLM, penalty: dict[str, float]
) -> None:
    plain = offline.generate(PROMPT, params(24), use_tqdm=False)[0].outputs[0]
    expected = offline.generate(PROMPT, params(24, **penalty), use_tqdm=False)[0].outputs[0]
    # The penalty changes the greedy answer, so a server that dropped it would fail here.
    assert expected.token_ids != plain.token_ids
    extra: dict[str, Any] = {"ignore_eos": True, "return_token_ids": True}
    if "repetition_penalty" in penalty:
        extra |= penalty
        response = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, extra_body=extra
        )
    else:
        response = client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            extra_body=extra,
            **penalty,  # type: ignore[arg-type]
        )
    assert token_ids_of(response.choices[0]) == expected.token_ids


def test_logit_bias_bans_and_forces(client: openai.OpenAI) -> None:
    extra: dict[str, Any] = {"ignore_eos": True, "return_token_ids": True}

    def generate(**fields: Any) -> list[int]:
        choice = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, extra_body=extra, **fields
        ).choices[0]
        return token_ids_of(choice)

    plain = generate()
    banned = plain[0]  # what greedy produces first
    without = generate(logit_bias={str(banned): -100})
    assert banned not in without and len(without) == 12
    forced = next(t for t in range(3, VOCAB_SIZE) if t not in plain)
    assert generate(logit_bias={str(forced): 100}) == [forced] * 12
    # vLLM's allowed_token_ids and bad_words work as well.
    extra["allowed_token_ids"] = [forced]
    assert generate() == [forced] * 12
    del extra["allowed_token_ids"]
    extra["bad_words"] = [f"w{banned}"]
    assert banned not in generate()


BAD_COMPLETIONS: list[tuple[dict[str, Any], str, list[str]]] = [
    ({"n": 0}, "n", []),
    ({"logprobs": 21}, "logprobs", ["21", "20"]),
    ({"presence_penalty": 2.5}, "presence_penalty", []),
    ({"frequency_penalty": -2.5}, "frequency_penalty", []),
    ({"repetition_penalty": 0}, "repetition_penalty", []),
    ({"logit_bias": {"999999": 1}}, "logit_bias", ["999999", str(VOCAB_SIZE)]),
    ({"logit_bias": {"5": 101}}, "logit_bias", []),
    ({"logit_bias": {"w5": 1}}, "logit_bias", []),
    ({"allowed_token_ids": []}, "allowed_token_ids", []),
    ({"best_of": 2}, "best_of", ["best_of", "n"]),
    ({"max_tokens": 0}, "max_tokens", []),
]


@pytest.mark.parametrize(("fields", "param", "words"), BAD_COMPLETIONS)
def test_bad_values_are_400s(
    client: openai.OpenAI, fields: dict[str, Any], param: str, words: list[str]
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, extra_body=fields)
    assert raised.value.status_code == 400
    error = raised.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert all(word in error["message"] for word in words), error


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true (OpenAI, vLLM)
        ({"n": 0}, "n"),
    ],
)
def test_bad_chat_values_are_400s(
    tiny_server: ServerProcess, fields: dict[str, Any], param: str
) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2} | fields
    response = httpx.post(
        f"{tiny_server.url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param, response.text
