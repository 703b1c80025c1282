"""A Responses API request in chat-completions terms.

``/v1/responses`` renders, constrains and parses through the chat machinery, so one
request gives the same prompt (and greedy answer) on both routes:

- ``instructions`` is a system message first; a string ``input`` is one user message.
- input items -> chat messages (as vLLM's ``construct_input_messages``):

  ==========================================  =========================================
  ``{role, content}`` (``type: "message"``)    ``{role, content}``; ``input_text`` /
                                               ``output_text`` / ``refusal`` parts are
                                               text parts
  ``{type: function_call, call_id, name,       an assistant ``tool_calls`` entry, added
  arguments}``                                 to the assistant message just before it
  ``{type: function_call_output, call_id,      ``{role: tool, tool_call_id, content}``
  output}``
  ==========================================  =========================================

  A final assistant message whose ``status`` is ``in_progress`` or ``incomplete`` is
  continued rather than answered (vLLM's rule). Images, files, audio, reasoning items,
  item references and built-in tool items are refused by name: a text-only model with
  no store has nothing to read them with.
- ``tools`` in the flat Responses form -> chat's ``{type: function, function: {...}}``;
  ``tool_choice {type: function, name}`` -> chat's named choice. Built-in tools and other
  choices are 400s.
- ``text.format`` is chat's ``response_format`` (``json_schema`` flattened).

Every refusal is a 400 naming the field (and the item, in the message).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from inflight.entrypoints.openai.errors import OpenAIError, bad_request
from inflight.entrypoints.openai.protocol import ChatMessage

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# OpenAI's ResponseIncludable. Only the logprobs add anything here: the others name output
# this server never produces (built-in tool results, input images, encrypted reasoning).
INCLUDABLE = frozenset({
    LOGPROBS_INCLUDE, "file_search_call.results", "web_search_call.results",
    "web_search_call.action.sources", "message.input_image.image_url",
    "computer_call_output.output.image_url", "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
})
_ROLES = ("user", "system", "developer", "assistant")
_OPEN_STATUSES = ("in_progress", "incomplete")
# Keys of a function tool whose other values would ask for what this server cannot do.
_TOOL_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "defer_loading": (None, False),
    "async": (None, False),
    "allowed_callers": (None, ["direct"]),
}


@dataclass(frozen=True, slots=True)
class ChatInput:
    """The conversation to render, and whether its final assistant message is continued."""

    messages: list[ChatMessage]
    continue_final_message: bool


def chat_input(instructions: str | None, items: str | list[dict[str, Any]]) -> ChatInput:
    """The request's ``instructions`` and ``input`` as chat messages."""
    if not items:
        raise bad_request("'input' must be a non-empty string or list of items.", "input")
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        return ChatInput(_validated(messages), False)
    for index, item in enumerate(items):
        _add_item(messages, index, item)
    last = items[-1]
    continued = (
        last.get("type", "message") == "message"
        and last.get("role") == "assistant"
        and last.get("status") in _OPEN_STATUSES
    )
    return ChatInput(_validated(messages), continued)


def _add_item(messages: list[dict[str, Any]], index: int, item: dict[str, Any]) -> None:
    where = f"input[{index}]"
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise _bad_input(f"{where}.role must be one of {list(_ROLES)}, got {role!r}.")
        messages.append({"role": role, "content": _content(where, item.get("content"))})
    elif kind == "function_call":
        call = {
            "id": _string(where, item, "call_id"),
            "type": "function",
            "function": {
                "name": _string(where, item, "name"),
                "arguments": _string(where, item, "arguments"),
            },
        }
        previous = messages[-1] if messages else None
        if previous is not None and previous["role"] == "assistant":
            previous.setdefault("tool_calls", []).append(call)  # one turn, as in vLLM
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        messages.append({
            "role": "tool",
            "tool_call_id": _string(where, item, "call_id"),
            "content": _content(where, output, "output"),
        })
    else:
        raise _bad_input(f"{where}: items of type {kind!r} are not supported: {_why_not(kind)}.")


def _why_not(kind: Any) -> str:
    if kind == "reasoning":
        return "this model has no reasoning mode"
    if kind == "item_reference":
        return "this server keeps no items to refer to; send the item itself"
    return "this server takes messages, function_call and function_call_output items only"


def _content(where: str, content: Any, field: str = "content") -> str | list[dict[str, str]]:
    """A message's ``content`` (or a function call's ``output``): a string, or its parts
    as chat text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad_input(f"{where}.{field} must be a string or a list of content parts.")
    parts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        key = {"input_text": "text", "output_text": "text", "refusal": "refusal"}.get(str(kind))
        if key is None:
            raise _bad_input(
                f"{where}.{field}[{index}]: parts of type {kind!r} are not supported: the "
                "Responses API's text parts are 'input_text' (and 'output_text' or "
                "'refusal' in assistant turns); this model reads no images or files."
            )
        text = part.get(key)
        if not isinstance(text, str):
            raise _bad_input(f"{where}.{field}[{index}] needs a string '{key}'.")
        parts.append({"type": "text", "text": text})
    return parts


def _string(where: str, item: Mapping[str, Any], key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _bad_input(f"{where}.{key} must be a string.")
    return value


def _validated(messages: list[dict[str, Any]]) -> list[ChatMessage]:
    """Chat's own message checks (function arguments must be JSON text, ...)."""
    try:
        return [ChatMessage.model_validate(message) for message in messages]
    except ValidationError as error:
        detail = error.errors(include_url=False)[0]["msg"].removeprefix("Value error, ")
        raise _bad_input(f"Invalid input: {detail}.") from None


def _bad_input(message: str) -> OpenAIError:
    return bad_request(message, "input")


# ---------------------------------------------------------------------- tools, text


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Flat Responses function tools as chat tools (``tool_calls.parse_tools`` checks them)."""
    if tools is None:
        return None
    out = []
    for index, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise bad_request(
                f"tools[{index}]: tools of type {kind!r} are not supported: this server runs "
                "function tools only (no built-in tools).",
                "tools",
            )
        for key, neutral in _TOOL_NEUTRAL.items():
            if tool.get(key) not in neutral:
                raise bad_request(f"tools[{index}].{key} is not supported.", "tools")
        # strict is accepted: a required or named choice's grammar enforces the schema.
        # output_schema describes the function's result, which the model never writes.
        keys = ("name", "description", "parameters", "strict")
        out.append({"type": "function", "function": {k: tool[k] for k in keys if k in tool}})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Responses' ``{type: function, name}`` as chat's named choice; strings as they are.
    Errors describe the Responses forms (flat ``name``), not chat's."""
    forms = "'none', 'auto', 'required' or {'type': 'function', 'name': ...}"
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if not isinstance(choice, dict):
        raise bad_request(f"tool_choice must be {forms}, got {choice!r}.", "tool_choice")
    if choice.get("type") != "function":
        raise bad_request(
            f"tool_choice of type {choice.get('type')!r} is not supported: use {forms}.",
            "tool_choice",
        )
    name = choice.get("name")
    if not isinstance(name, str):
        hint = " (chat's nested form; the Responses API names the function flat)" if (
            "function" in choice) else ""
        raise bad_request(
            "A named tool_choice must be {'type': 'function', 'name': ...}, got "
            f"{choice!r}{hint}.",
            "tool_choice",
        )
    return {"type": "function", "function": {"name": name}}


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (``structured.py`` checks it)."""
    if text is None:
        return None
    if text.get("verbosity") not in (None, "medium"):
        raise bad_request(
            "'text.verbosity' is not supported: this model has no verbosity setting.",
            "text.verbosity",
            "unsupported_parameter",
        )
    form = text.get("format")
    if form is not None and not isinstance(form, dict):
        raise bad_request("Invalid text.format: it must be an object with a 'type'.", "text.format")
    if form is None or form.get("type") != "json_schema":
        return form
    if not isinstance(form.get("schema"), dict):  # required here, unlike chat's
        raise bad_request(
            "Invalid text.format: a json_schema format needs a 'schema' object.", "text.format"
        )
    spec = {k: form[k] for k in ("name", "description", "schema", "strict") if k in form}
    return {"type": "json_schema", "json_schema": spec}


def wants_logprobs(include: list[str] | None) -> bool:
    """Whether ``include`` asks for the output's logprobs; unknown values are 400s."""
    unknown = sorted(set(include or []) - INCLUDABLE)
    if unknown:
        raise bad_request(
            f"Unknown 'include' value(s) {unknown}: expected some of {sorted(INCLUDABLE)}.",
            "include",
        )
    return LOGPROBS_INCLUDE in (include or [])
