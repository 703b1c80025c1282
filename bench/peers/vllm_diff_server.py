"""The same HTTP requests to a vLLM server and to an inflight server, and where answers differ.

Both servers run greedy on the same float32 checkpoint (README.md here shows how to start
them). The first form sends every case to one server and writes its normalised answers;
``--compare`` lists every case whose answers differ, value differences and key-set
differences (a key one server carries and the other lacks) apart.

    .venv/bin/python bench/peers/vllm_diff_server.py http://127.0.0.1:PORT out.json
    .venv/bin/python bench/peers/vllm_diff_server.py --compare inflight.json vllm.json

Normalised: ids, ``created``/``created_at``, ``system_fingerprint`` and the model name are
dropped; tool-call arguments are parsed as JSON; floats (logprobs) agree to 0.02. A stream
is folded into its texts, finish reasons, tool calls, first-delta role and usage chunks (a
Responses stream into its event types, runs of one type counted once). An error is only its
status code and whether ``error`` has ``message``, ``type`` and ``code``.

Run on 2026-12-07 against vLLM 0.32.0 (CPU build), 107 cases, it found what was fixed that
day: Responses objects lacking keys of vLLM's, and a ``max_tokens`` past the context refused
(a 400) where vLLM 0.32 cuts it to the room the prompt leaves. Then 0 of 107 cases differed
but in these deliberate ways (``DELIBERATE``, by number; 80 cases show one):

1. ``usage.prompt_tokens_details``: always ``{"cached_tokens": N}`` (OpenAI's usage); vLLM
   fills it only with ``--enable-prompt-tokens-details``.
2. ``n`` > 1 at temperature 0: n identical answers (tested as such); vLLM 0.32 answers 400.
3. ``best_of`` other than ``n``: a 400 saying no extra candidates are ranked; vLLM 0.32's
   completions have no ``best_of`` and ignore it.
4. Tools on SmolLM2 (a template without a tool format): inflight writes the Hermes tool
   prompt into the system message, vLLM hands the template ``tools`` that it ignores, so the
   prompts, texts and counts differ; a call's message has ``content: null`` (OpenAI's), vLLM
   ``""``. vLLM's named and required calls gave ``"Paris"`` as arguments, not the schema's
   object: its fault, not ours.
5. Responses echo OpenAI's defaults (``tool_choice: "auto"``, ``metadata: {}``, ``text``
   format text; vLLM ``"none"`` without tools, nulls), and a message cut by
   ``max_output_tokens`` is ``incomplete`` (vLLM ``completed``).
6. An unknown route is OpenAI's error object (404); vLLM sends FastAPI's ``{"detail": ...}``.
7. ``/v1/models``: ``owned_by: "inflight"``, and no legacy ``permission`` list.
8. Keys only inflight carries, null or OpenAI's: a message's ``reasoning_content`` and
   ``tool_calls: []``, ``logprobs.refusal``, a whole answer's keys in every stream chunk,
   Responses' ``error``, ``store``, ``safety_identifier``, ``prompt_cache_key``.
9. ``echo`` with ``max_tokens: 0`` counts 0 completion tokens; vLLM counts 1 (its engine
   samples a token that the answer leaves out).
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import httpx

P = "The capital of France is"
Q = "List three colors, one per line:"
CHAT = "<|im_start|>user\nWhat is 2+2? Answer briefly.<|im_end|>\n<|im_start|>assistant\n"
P_IDS = [504, 3575, 282, 4649, 314]
PARIS = 7042
DROPPED = {"id", "created", "created_at", "system_fingerprint", "model", "call_id", "item_id", "root"}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
USER = [{"role": "user", "content": "What is 2+2? Answer briefly."}]
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
CO, CH, RE = "/v1/completions", "/v1/chat/completions", "/v1/responses"


# The differences judged deliberate (see the docstring), as patterns on "case difference".
DELIBERATE = (
    r"prompt_tokens_details: \{\"cached_tokens\": 0\} / null",  # 1
    r"^\w+\.(stream_)?n_2 status 200 / 400", r"^completions\.best_of_2 status 400 / 200",  # 2, 3
    r"^chat\.(stream_)?tools_\w+ (?!keys)",  # 4
    r"^responses\.\w+ (\.final)?(\.tool_choice|\.metadata|\.text|\.output\[0\]\.status)",  # 5
    r"^error\.unknown_path error body",  # 6
    r"^models (\.data\[0\]\.owned_by|keys \.data\[\]: only first \[\], only second \['permission'\]$)",  # 7
    r" keys .*only second \[\]$",  # 8
    r"^completions\.echo_max_tokens_0\w* \.usage\.(completion|total)_tokens",  # 9
)


def _completion_cases() -> dict[str, dict[str, Any]]:
    """name -> /v1/completions body (temperature 0 and the model added)."""
    return {
        "greedy": dict(prompt=P, max_tokens=16), "no_max_tokens": dict(prompt=CHAT),
        "max_tokens_null": dict(prompt=CHAT, max_tokens=None),
        "stop_string": dict(prompt=P, max_tokens=24, stop="."),
        "stop_list": dict(prompt=P, max_tokens=24, stop=["\n", "."]),
        "stop_included": dict(prompt=P, max_tokens=24, stop=["."], include_stop_str_in_output=True),
        "stop_token_ids": dict(prompt=P, max_tokens=24, stop_token_ids=[30]),
        "echo": dict(prompt=P, max_tokens=4, echo=True),
        "echo_max_tokens_0": dict(prompt=P, max_tokens=0, echo=True),
        "echo_logprobs": dict(prompt=P, max_tokens=3, echo=True, logprobs=2),
        "echo_max_tokens_0_logprobs": dict(prompt=P, max_tokens=0, echo=True, logprobs=1),
        **{f"logprobs_{k}": dict(prompt=P, max_tokens=4, logprobs=k) for k in (0, 1, 5)},
        "prompt_token_ids": dict(prompt=P_IDS, max_tokens=8),
        "batch_strings": dict(prompt=[P, Q], max_tokens=8),
        "batch_token_ids": dict(prompt=[P_IDS, P_IDS[:3]], max_tokens=6),
        "n_2": dict(prompt=P, max_tokens=6, n=2), "suffix": dict(prompt=P, max_tokens=6, suffix=" end."),
        "best_of_2": dict(prompt=P, max_tokens=6, best_of=2), "seed": dict(prompt=P, max_tokens=8, seed=7),
        "min_tokens": dict(prompt=CHAT, max_tokens=30, min_tokens=15),
        "ignore_eos": dict(prompt=CHAT, max_tokens=20, ignore_eos=True, skip_special_tokens=False),
        "skip_special_tokens_false": dict(prompt=CHAT, max_tokens=30, skip_special_tokens=False),
        **{k: dict(prompt=Q, max_tokens=30, **{k: 1.5}) for k in (
            "repetition_penalty", "presence_penalty", "frequency_penalty")},
        "logit_bias": dict(prompt=P, max_tokens=8, logit_bias={str(PARIS): -100}),
        "bad_words": dict(prompt=P, max_tokens=12, bad_words=["Paris", "capital of France"]),
        "allowed_token_ids": dict(prompt=P, max_tokens=6, allowed_token_ids=[PARIS, 13, 30, 314]),
        "prompt_logprobs": dict(prompt=P, max_tokens=2, prompt_logprobs=2),
        "tokens_as_token_ids": dict(prompt=P, max_tokens=3, logprobs=2, return_tokens_as_token_ids=True),
        "return_token_ids": dict(prompt=P, max_tokens=3, return_token_ids=True),
        "top_k_1": dict(prompt=P, max_tokens=8, temperature=1.0, top_k=1),
        "structured_choice": dict(prompt="Is the sky blue? Answer:", max_tokens=20,
                                  structured_outputs={"choice": ["yes", "no", "maybe"]}),
        "structured_regex": dict(prompt="Phone number:", max_tokens=20,
                                 structured_outputs={"regex": r"\d{3}-\d{4}"}),
        "structured_json": dict(prompt="A person as JSON:", max_tokens=60, structured_outputs={"json": PERSON}),
        "response_format_json_schema": dict(prompt="A person as JSON:", max_tokens=60, response_format={
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}),
        "stream": dict(prompt=P, max_tokens=10, stream=True), "stream_usage": dict(
            prompt=P, max_tokens=10, stream=True, stream_options={"include_usage": True}),
        "stream_stop": dict(prompt=P, max_tokens=24, stop=["."], stream=True),
        "stream_logprobs": dict(prompt=P, max_tokens=4, logprobs=2, stream=True),
        "stream_batch": dict(prompt=[P, Q], max_tokens=6, stream=True, stream_options={"include_usage": True}),
        "stream_echo": dict(prompt=P, max_tokens=4, echo=True, stream=True),
        "context_limit": dict(prompt="word " * 2040, max_tokens=50),
    }


def _chat_cases() -> dict[str, dict[str, Any]]:
    """name -> /v1/chat/completions body (temperature 0 and the model added)."""
    turns = [{"role": "user", "content": "Hi, I am Ann."}, {"role": "assistant", "content": "Hello Ann!"},
             {"role": "user", "content": "What is my name?"}]
    tools = dict(messages=ASK_WEATHER, tools=WEATHER, max_tokens=60)
    return {
        "basic": dict(messages=USER, max_tokens=20),
        "system": dict(messages=[{"role": "system", "content": "Answer in French."}, *USER], max_tokens=20),
        "developer": dict(messages=[{"role": "developer", "content": "Be brief."}, *USER], max_tokens=20),
        "multi_turn": dict(messages=turns, max_tokens=20),
        "content_parts": dict(max_tokens=12, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]}]),
        "logprobs": dict(messages=USER, max_tokens=5, logprobs=True),
        "top_logprobs": dict(messages=USER, max_tokens=5, logprobs=True, top_logprobs=3),
        "max_completion_tokens": dict(messages=USER, max_completion_tokens=5),
        "no_max_tokens": dict(messages=USER), "stop": dict(messages=USER, max_tokens=20, stop=["4"]),
        "n_2": dict(messages=USER, max_tokens=8, n=2),
        "skip_special_tokens_false": dict(messages=USER, max_tokens=30, skip_special_tokens=False),
        "json_object": dict(messages=[{"role": "user", "content": "A person as JSON."}], max_tokens=40,
                            response_format={"type": "json_object"}),
        "json_schema": dict(messages=[{"role": "user", "content": "A person as JSON."}], max_tokens=60,
                            response_format={"type": "json_schema",
                                             "json_schema": {"name": "p", "schema": PERSON}}),
        "structured_choice": dict(messages=USER, max_tokens=5, structured_outputs={"choice": ["4", "5"]}),
        "tools_required": dict(**tools, tool_choice="required"),
        "tools_named": dict(**tools, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        "tools_none": dict(**tools, tool_choice="none"), "tools_auto": dict(**tools, tool_choice="auto"),
        "continue_final_message": dict(max_tokens=8, add_generation_prompt=False, continue_final_message=True,
                                       messages=[*USER, {"role": "assistant", "content": "The answer is"}]),
        "no_generation_prompt": dict(messages=USER, max_tokens=8, add_generation_prompt=False),
        "echo": dict(max_tokens=8, echo=True, add_generation_prompt=False, continue_final_message=True,
                     messages=[*USER, {"role": "assistant", "content": "The answer is"}]),
        "stream": dict(messages=USER, max_tokens=20, stream=True),
        "stream_usage": dict(messages=USER, max_tokens=20, stream=True, stream_options={"include_usage": True}),
        "stream_logprobs": dict(messages=USER, max_tokens=4, stream=True, logprobs=True, top_logprobs=2),
        "stream_n_2": dict(messages=USER, max_tokens=6, n=2, stream=True),
        "stream_tools_named": dict(**tools, stream=True,
                                   tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        "stream_tools_required": dict(**tools, stream=True, tool_choice="required"),
    }


def _other_cases() -> dict[str, tuple[str, Any]]:
    """name -> (path, body); a str body is sent as is (invalid JSON), None means GET."""
    huge = "word " * 3000
    return {
        "responses.basic": (RE, dict(input="What is 2+2?", max_output_tokens=20)),
        "responses.instructions": (RE, dict(input="What is 2+2?", instructions="Answer in French.",
                                            max_output_tokens=20)),
        "responses.incomplete": (RE, dict(input="Count to twenty.", max_output_tokens=5)),
        "responses.messages": (RE, dict(input=USER, max_output_tokens=20)),
        "responses.stream": (RE, dict(input="What is 2+2?", max_output_tokens=10, stream=True)),
        "tokenize.prompt": ("/tokenize", dict(prompt=P)),
        "tokenize.token_strs": ("/tokenize", dict(prompt=P, return_token_strs=True, add_special_tokens=False)),
        "tokenize.messages": ("/tokenize", dict(messages=USER)),
        "detokenize": ("/detokenize", dict(tokens=P_IDS)), "models": ("/v1/models", None),
        "error.max_tokens_string": (CO, dict(prompt=P, max_tokens="ten")),
        "error.max_tokens_negative": (CO, dict(prompt=P, max_tokens=-1)),
        "error.temperature_negative": (CO, dict(prompt=P, max_tokens=4, temperature=-1)),
        "error.prompt_too_long": (CO, dict(prompt=huge, max_tokens=4)),
        "error.chat_prompt_too_long": (CH, dict(messages=[{"role": "user", "content": huge}])),
        "error.unknown_model": (CO, dict(prompt=P, max_tokens=4, model="no-such-model")),
        "error.chat_unknown_model": (CH, dict(messages=USER, model="no-such-model")),
        "error.missing_messages": (CH, dict(max_tokens=4)), "error.missing_prompt": (CO, dict(max_tokens=4)),
        "error.empty_prompt": (CO, dict(prompt="", max_tokens=4)),
        "error.empty_messages": (CH, dict(messages=[], max_tokens=4)),
        "error.top_logprobs_without_logprobs": (CH, dict(messages=USER, top_logprobs=2)),
        "error.top_logprobs_21": (CH, dict(messages=USER, logprobs=True, top_logprobs=21)),
        "error.logprobs_21": (CO, dict(prompt=P, max_tokens=2, logprobs=21)),
        "error.invalid_json": (CO, "{not json"), "error.n_0": (CO, dict(prompt=P, max_tokens=2, n=0)),
        "error.top_p_0": (CO, dict(prompt=P, max_tokens=2, top_p=0)),
        "error.stream_options_without_stream": (CO, dict(
            prompt=P, max_tokens=2, stream_options={"include_usage": True})),
        "error.bad_role": (CH, dict(messages=[{"role": "robot", "content": "hi"}])),
        "error.response_format_type": (CH, dict(messages=USER, response_format={"type": "xml"})),
        "error.tool_choice_unknown_function": (CH, dict(
            messages=ASK_WEATHER, tools=WEATHER,
            tool_choice={"type": "function", "function": {"name": "nope"}})),
        "error.tool_choice_required_no_tools": (CH, dict(messages=USER, tool_choice="required")),
        "error.messages_not_list": (CH, dict(messages="hi")),
        "error.unknown_path": ("/v1/nothing", dict(prompt=P)),
    }


def _keys(value: Any, path: str, into: dict[str, set[str]]) -> None:
    """Each dict's key set by path (list items merged under ``path[]``)."""
    if isinstance(value, dict):
        into.setdefault(path, set()).update(value)
        for k, v in value.items():
            _keys(v, f"{path}.{k}", into)
    elif isinstance(value, list):
        for v in value:
            _keys(v, f"{path}[]", into)


def _clean(value: Any) -> Any:
    """Without ids, timestamps and model names; JSON argument strings parsed."""
    if isinstance(value, dict):
        out = {k: _clean(v) for k, v in value.items() if k not in DROPPED}
        if isinstance(out.get("arguments"), str):
            try:
                out["arguments"] = json.loads(out["arguments"])
            except json.JSONDecodeError:
                pass
        return out
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _fold_stream(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A completions or chat stream as the answer it adds up to."""
    texts: dict[int, str] = {}
    finish: dict[int, Any] = {}
    tools: dict[str, dict[str, str]] = {}
    tokens: list[Any] = []
    first_role, usage_chunks, usage = None, 0, None
    for chunk in chunks:
        if chunk.get("usage"):
            usage_chunks, usage = usage_chunks + 1, chunk["usage"]
        for choice in chunk.get("choices") or []:
            i = choice.get("index", 0)
            delta = choice.get("delta") or {}
            if first_role is None and "delta" in choice:
                first_role = delta.get("role", "<none>")
            texts[i] = texts.get(i, "") + (choice.get("text") or delta.get("content") or "")
            for call in delta.get("tool_calls") or []:
                slot = tools.setdefault(f"{i}.{call.get('index')}", {"name": "", "arguments": ""})
                for part in slot:
                    slot[part] += (call.get("function") or {}).get(part) or ""
            if choice.get("finish_reason") is not None:
                finish[i] = [choice["finish_reason"], choice.get("stop_reason")]
            lp = choice.get("logprobs") or {}
            tokens += lp.get("tokens") or [c.get("token") for c in lp.get("content") or []]
    return _clean({"texts": texts, "finish": finish, "tool_calls": tools, "logprob_tokens": tokens,
                   "first_role": first_role, "usage_chunks": usage_chunks, "usage": usage})


def _fold_events(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A Responses stream as its event types (runs counted once) and the final response."""
    types: list[str] = []
    for event in events:
        if not types or types[-1] != event.get("type"):
            types.append(event.get("type", "?"))
    final = next((e["response"] for e in reversed(events) if "response" in e), None)
    return {"event_types": types, "final": _clean(final)}


def _ask(client: httpx.Client, path: str, body: Any) -> dict[str, Any]:
    if body is None:
        response = client.get(path)
    elif isinstance(body, str):
        response = client.post(path, content=body, headers={"content-type": "application/json"})
    elif body.get("stream"):
        with client.stream("POST", path, json=body) as streamed:
            if streamed.status_code != 200:
                streamed.read()
                response = streamed
            else:
                lines = [line[6:] for line in streamed.iter_lines() if line.startswith("data: ")]
                chunks = [json.loads(line) for line in lines if line != "[DONE]"]
                keys: dict[str, set[str]] = {}
                for chunk in chunks:
                    _keys(chunk, "chunk", keys)
                folded = _fold_events(chunks) if path == "/v1/responses" else _fold_stream(chunks)
                folded["ends_with_done"] = lines[-1:] == ["[DONE]"]
                return {"status": 200, "answer": folded, "keys": {k: sorted(v) for k, v in keys.items()}}
    else:
        response = client.post(path, json=body)
    try:
        data = response.json()
    except ValueError:
        data = response.text[:200]
    if response.status_code != 200:
        error = data.get("error") if isinstance(data, dict) else None
        has = isinstance(error, dict) and {"message", "type", "code"} <= error.keys()
        return {"status": response.status_code, "error_has_message_type_code": has,
                "message": str(error.get("message") if isinstance(error, dict) else data)[:200]}
    keys = {}
    _keys(data, "", keys)
    return {"status": 200, "answer": _clean(data), "keys": {k: sorted(v) for k, v in keys.items()}}


def run(base_url: str, out_path: str) -> None:
    cases: dict[str, tuple[str, Any]] = {f"completions.{n}": (CO, b) for n, b in _completion_cases().items()}
    cases |= {f"chat.{n}": (CH, b) for n, b in _chat_cases().items()} | _other_cases()
    results: dict[str, Any] = {}
    with httpx.Client(base_url=base_url, timeout=600) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        for name, (path, body) in cases.items():
            if isinstance(body, dict):
                greedy = {} if path in ("/tokenize", "/detokenize") else {"temperature": 0.0}
                body = {"model": model, **greedy, **body}
            results[name] = _ask(client, path, body)
            print(name, json.dumps(results[name].get("answer", results[name]))[:150], flush=True)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where a and b differ, on the keys both carry, with floats (logprobs) to 0.02."""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return [] if abs(a - b) <= 0.02 else [f"{path}: {a} / {b}"]
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(a.keys() & b.keys()) for d in _differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in _differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {json.dumps(a)[:200]} / {json.dumps(b)[:200]}"]


def _key_differences(a: dict[str, list[str]], b: dict[str, list[str]]) -> list[str]:
    out = []
    for path in sorted(a.keys() & b.keys()):
        only_a, only_b = set(a[path]) - set(b[path]), set(b[path]) - set(a[path])
        if only_a or only_b:
            out.append(f"keys {path or '.'}: only first {sorted(only_a)}, only second {sorted(only_b)}")
    return out


def _case_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    if a["status"] != 200 and a["status"] == b["status"]:
        same = a["error_has_message_type_code"] and b["error_has_message_type_code"]
        return [] if same else [f"error body without message, type, code: {a['message']} / {b['message']}"]
    if a["status"] != b["status"]:
        return [f"status {a['status']} / {b['status']}: {json.dumps(a.get('answer', a))[:200]}"
                f" / {json.dumps(b.get('answer', b))[:200]}"]
    return _differences(a["answer"], b["answer"]) + _key_differences(a["keys"], b["keys"])


def compare(first_path: str, second_path: str) -> int:
    """Lists the differing cases; the first file is inflight's, for ``DELIBERATE``."""
    with open(first_path) as f:
        first = json.load(f)
    with open(second_path) as f:
        second = json.load(f)
    names = sorted(first.keys() | second.keys())
    differing, deliberate = 0, []
    for name in names:
        a, b = first.get(name), second.get(name)
        diffs = ["in one file only"] if a is None or b is None else _case_differences(a, b)
        new = [d for d in diffs if not any(re.search(p, f"{name} {d}") for p in DELIBERATE)]
        if new:
            differing += 1
            print(f"{name}\n  " + "\n  ".join(new))
        elif diffs:
            deliberate.append(name)
    print(f"deliberate only: {' '.join(deliberate)}")
    print(f"{differing} of {len(names)} cases differ ({len(deliberate)} more only in deliberate ways)")
    return 1 if differing else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--compare":
        sys.exit(compare(*sys.argv[2:]))
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    run(*sys.argv[1:])
