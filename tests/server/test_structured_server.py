"""Structured outputs through the server: ``response_format`` and vLLM's ``structured_outputs``.

The default model (SmolLM2) is served once for the module: llguidance cannot read the tiny
model's word-level tokenizer. References: the schema itself (``jsonschema``), the regex
(``re.fullmatch``), the choices, and the offline engine's greedy output under the same
constraint. Malformed constraints are refused before the engine sees them, so those 400s
are checked on the shared tiny server.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel
from server_harness import API_KEY, ServerProcess

from inflight import LLM, SamplingParams
from inflight.sampling_params import StructuredOutputsParams

MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


class City(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def server(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    return start_server("--max-num-seqs", "4")


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_parse_returns_the_pydantic_object(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a city in France, as JSON."}],
        response_format=City,
        max_tokens=40,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, City)
    assert City.model_validate_json(choice.message.content or "") == choice.message.parsed


def test_json_schema_matches_the_offline_engine(client: openai.OpenAI) -> None:
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
    }
    prompt = "A person as JSON:"
    completion = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=40,
        temperature=0,
        extra_body={"response_format": response_format},
    )
    text = completion.choices[0].text
    jsonschema.validate(json.loads(text), SCHEMA)
    params = SamplingParams(
        temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    offline = LLM(max_num_seqs=4).generate(prompt, params, use_tqdm=False)[0]
    assert text == offline.outputs[0].text


def test_chat_json_schema_and_json_object_parse(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Describe a person."}]
    for response_format, schema in [
        ({"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}, SCHEMA),
        ({"type": "json_object"}, {"type": "object"}),
    ]:
        response = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=60,
            temperature=0,
            response_format=response_format,  # type: ignore[arg-type]
        )
        jsonschema.validate(json.loads(response.choices[0].message.content or ""), schema)


def test_structured_outputs_regex_choice_and_streaming(client: openai.OpenAI) -> None:
    regex = r"[0-9]{3}-[0-9]{4}"
    completion = client.completions.create(
        model=MODEL,
        prompt="A phone number:",
        max_tokens=20,
        temperature=0.8,
        seed=3,
        extra_body={"structured_outputs": {"regex": regex}},
    )
    assert re.fullmatch(regex, completion.choices[0].text), completion.choices[0].text
    choices = ["yes", "no", "maybe"]
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Is the sky green?"}],
        "max_tokens": 10,
        "temperature": 0,
    }
    answer = client.chat.completions.create(
        **body, extra_body={"structured_outputs": {"choice": choices}}
    )
    assert answer.choices[0].message.content in choices
    stream = client.chat.completions.create(
        **body, extra_body={"structured_outputs": {"choice": choices}}, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == (
        answer.choices[0].message.content
    )


BAD = [
    (
        "/v1/chat/completions",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            }
        },
        "response_format",
    ),
    (
        "/v1/completions",
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
        "response_format",
    ),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format"),
    ("/v1/completions", {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"grammar": "start: ???"}}, "structured_outputs"),
    (
        "/v1/chat/completions",
        {"structured_outputs": {"regex": "a", "choice": ["a"]}},
        "structured_outputs",
    ),
    ("/v1/chat/completions", {"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"choice": "ab"}}, "structured_outputs"),
    (
        "/v1/completions",
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "structured_outputs",
    ),
]


@pytest.mark.parametrize(("path", "patch", "param"), BAD)
def test_bad_constraints_are_400s_and_the_server_keeps_serving(
    tiny_server: ServerProcess, path: str, patch: dict[str, Any], param: str
) -> None:
    if path == "/v1/completions":
        body: dict[str, Any] = {"model": "tiny", "prompt": "w3 w4", "max_tokens": 2}
    else:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "w3"}], "max_tokens": 2}
    url = f"{tiny_server.url}{path}"
    response = httpx.post(url, json=body | patch, headers=AUTH, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    ok = httpx.post(url, json=body | {"temperature": 0}, headers=AUTH, timeout=60)
    assert ok.status_code == 200, ok.text


def test_constraints_too_large_or_complex_for_the_grammar_engine(client: openai.OpenAI) -> None:
    """5000 choices are followed (llguidance's own choice grammar stops at 2000); a regex
    too complex for its lexer is a 400 naming structured_outputs, the second time too
    (a failed grammar is never reused), with a message of reasonable size."""
    choices = [f"c{i}" for i in range(5000)]
    response = client.completions.create(
        model=MODEL, prompt="Pick:", max_tokens=6, extra_body={"structured_outputs": {"choice": choices}},
    )
    assert response.choices[0].text in choices
    for _ in range(2):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(
                model=MODEL, prompt="Q:", max_tokens=5,
                extra_body={"structured_outputs": {"regex": "(a{1000}){1000}"}},
            )
        error = info.value.body
        assert error["param"] == "structured_outputs"  # type: ignore[index]
        assert "too many expressions" in error["message"] and len(error["message"]) < 1000  # type: ignore[index]
