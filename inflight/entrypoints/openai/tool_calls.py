"""Tool calling on chat completions: ``tools``, ``tool_choice``, their grammar and rendering.

- ``tools``: a list of ``{"type": "function", "function": {"name", "description",
  "parameters"}}``; anything else is a 400 naming ``tools``.
- ``tool_choice``: ``"none"`` (plain text), ``"auto"`` (the default when tools are given:
  the answer is parsed for tool calls), ``"required"`` (one or more calls to the tools; one
  with ``parallel_tool_calls: false``) or ``{"type": "function", "function": {"name": ...}}``
  (one call to that tool). ``"required"`` and named choices are enforced by a JSON schema
  grammar, so the arguments always parse and match the function's ``parameters``: for
  ``"required"`` the answer is a JSON array of ``{"name": ..., "arguments": {...}}``
  objects (one branch per tool; vLLM's form, as OpenAI may answer with parallel calls), for
  a named tool it is the arguments object itself. Such an answer ends when its grammar
  does: the request's ``stop`` strings and ``stop_token_ids`` apply to text answers only
  (:func:`tool_answer_params`), as OpenAI's ``stop`` never cuts a call's arguments; and
  it is only calls, so ``response_format`` / ``structured_outputs`` (which constrain text
  answers) give way to it, as in vLLM. Keywords the grammar cannot enforce (``uniqueItems``,
  ``not``: pydantic writes the first for every ``set`` field) are left unenforced in
  arguments, as OpenAI's non-strict tools leave them, rather than refused.
- ``"auto"`` answers are parsed (``tool_parsing.py``) with the Hermes format
  (``--tool-call-parser hermes``): each
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block is a call, the text
  before the first block is the content.

Rendering: a chat template that knows tools (it mentions ``tools``) gets them as
``apply_chat_template(tools=...)``. Others (SmolLM2's) get the documented default: the
Hermes tool prompt (:func:`default_tool_prompt`) appended to the system message (or in a new
one), assistant ``tool_calls`` written as ``<tool_call>`` blocks in the content, and
``role: "tool"`` results wrapped in ``<tool_response>`` tags.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from inflight.entrypoints.chat_utils import ChatOptions
from inflight.entrypoints.openai.errors import bad_request
from inflight.entrypoints.openai.structured import checked
from inflight.sampling_params import SamplingParams, StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes",)
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"


@dataclass(frozen=True, slots=True)
class FunctionTool:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """``mode`` is none, auto, required or named (then ``name`` is the tool's)."""

    mode: str
    name: str | None = None

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")


# ---------------------------------------------------------------------- request fields


def parse_tools(tools: Sequence[Any] | None, flat: bool = False) -> list[FunctionTool]:
    """The request's tools, checked; a 400 naming ``tools`` otherwise.

    ``flat``: the tools came as the Responses API writes them (``tools[i].name``, not
    chat's ``tools[i].function.name``), so errors name the fields that way. ``parameters``
    must be an object schema (OpenAI's rule: arguments are a JSON object); one without a
    ``type`` is taken as ``type: object``, a missing or empty one as no parameters.
    """
    parsed: list[FunctionTool] = []
    for index, tool in enumerate(tools or []):
        where = f"tools[{index}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise bad_request(f"{where} must be an object with type 'function'.", "tools")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise bad_request(f"{where}.function must be an object.", "tools")
        field = where if flat else f"{where}.function"
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad_request(
                f"{field}.name must be 1-64 letters, digits, '_' or '-', got {name!r}.",
                "tools",
            )
        parameters = _object_schema(function.get("parameters"), f"{field}.parameters")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise bad_request(f"{field}.description must be a string.", "tools")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request(f"{field}.strict must be a boolean.", "tools")
        parsed.append(FunctionTool(name, description, parameters))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct function names.", "tools")
    return parsed


def _object_schema(parameters: Any, field: str) -> dict[str, Any]:
    """A function's ``parameters`` as an object schema; a 400 naming ``field`` otherwise."""
    if parameters is None or parameters == {}:
        return _NO_PARAMETERS
    if not isinstance(parameters, dict):
        raise bad_request(
            f"{field} must be a JSON schema object, got {type(parameters).__name__}.", "tools"
        )
    kind = parameters.get("type", "object")
    if kind != "object":
        raise bad_request(
            f"{field} must be a JSON schema of type 'object' (the arguments are a JSON "
            f"object), got type {kind!r}.",
            "tools",
        )
    return {"type": "object", **parameters}


def parse_tool_choice(value: Any, tools: Sequence[FunctionTool]) -> ToolChoice:
    """OpenAI's ``tool_choice`` (default: auto with tools, none without); 400s name it."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value in ("none", "auto", "required"):
        if value != "none" and not tools:
            raise bad_request(f"tool_choice {value!r} needs a non-empty 'tools'.", "tool_choice")
        return ToolChoice(value)
    if isinstance(value, Mapping) and value.get("type") == "function":
        function = value.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            hint = (" (the Responses API's flat form; chat nests the name)"
                    if "name" in value else "")
            raise bad_request(
                'A named tool_choice must be {"type": "function", "function": {"name": ...}}'
                f", got {dict(value)!r}{hint}.",
                "tool_choice",
            )
        name = function["name"]
        known = [t.name for t in tools]
        if name not in known:
            raise bad_request(
                f"tool_choice names the function {name!r}, which is not in tools {known}.",
                "tool_choice",
            )
        return ToolChoice("named", name)
    raise bad_request(
        "tool_choice must be 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}.',
        "tool_choice",
    )


def tool_constraint(
    tools: Sequence[FunctionTool], choice: ToolChoice, parallel: bool = True
) -> StructuredOutputsParams:
    """The grammar of a required or named choice (see the module docstring); a required
    answer holds at most one call unless ``parallel`` (``parallel_tool_calls``)."""
    # Each tool on its own first, so an error names the tool and points into its own schema.
    chosen = [t for t in tools if choice.mode == "required" or t.name == choice.name]
    own = [
        checked(
            lambda t=tool: StructuredOutputsParams(json=_lenient(t.parameters)),
            "tools",
            f"function {tool.name!r} parameters",
        )
        for tool in chosen
    ]
    if choice.mode == "named":
        return own[0]
    # Each tool's parameters live at $defs/<tool>, with their own "#..." references
    # pointing there, so recursion ("#"), $defs and draft-07 definitions all still resolve
    # once the arguments sit under "arguments" (vLLM hoists $defs alone).
    definitions = {f"tool_{t.name}": _rebased(t.parameters, f"#/$defs/tool_{t.name}")
                   for t in tools}
    branches = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name},
                           "arguments": {"$ref": f"#/$defs/tool_{t.name}"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "items": branches[0] if len(branches) == 1 else {"anyOf": branches},
        "minItems": 1,
    }
    if not parallel:
        schema["maxItems"] = 1
    return checked(
        lambda: StructuredOutputsParams(json=_lenient({**schema, "$defs": definitions})), "tools"
    )


def _lenient(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with llguidance told to skip keywords it cannot enforce (``x-guidance``'s
    ``lenient``; a schema's own ``x-guidance`` settings are kept)."""
    options = schema.get("x-guidance")
    own = options if isinstance(options, dict) else {}
    return {**schema, "x-guidance": {"lenient": True, **own}}


def _rebased(schema: Any, base: str) -> Any:
    """``schema`` with every local ``$ref`` ("#", "#/...") made relative to ``base``.

    A subschema with an ``$id`` is a resource of its own: the local references inside it
    point into it wherever it sits (JSON Schema 2020-12, section 8.2.1), so it stays as it is.
    """
    if isinstance(schema, list):
        return [_rebased(item, base) for item in schema]
    if not isinstance(schema, dict) or isinstance(schema.get("$id"), str):
        return schema
    out = {key: _rebased(value, base) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = base + ref[1:]
    return out


def answer_constraint(
    tools: Sequence[FunctionTool],
    choice: ToolChoice,
    constraint: StructuredOutputsParams | None,
    format_param: str = "response_format",
    parallel: bool = True,
) -> StructuredOutputsParams | None:
    """The answer's grammar: a required or named choice's (at most one call unless
    ``parallel``), else the request's own ``constraint`` (from ``format_param`` or
    ``structured_outputs``, checked by the caller). With both, the choice's: its answer is
    only calls, and the format constrains text answers (vLLM and OpenAI accept the pair)."""
    if not choice.constrained:
        return constraint
    return tool_constraint(tools, choice, parallel)


def tool_answer_params(params: SamplingParams, choice: ToolChoice) -> SamplingParams:
    """``params`` for the answer under ``choice``: a required or named answer drops the
    request's stop strings and stop token ids (a ``"}"`` or ``"\\n"`` stop would cut the
    grammar's JSON, leaving arguments that do not parse); a text answer keeps them."""
    if not choice.constrained or not (params.stop or params.stop_token_ids):
        return params
    return replace(params, stop=[], stop_token_ids=[])


# ---------------------------------------------------------------------- rendering


def default_tool_prompt(tools: Sequence[FunctionTool]) -> str:
    """The Hermes tool prompt, for chat templates without a tool format of their own."""
    signatures = "\n".join(json.dumps(t.as_openai()) for t in tools)
    return (
        "You are a function calling AI model. You may call one or more functions to assist "
        "with the user query. Function signatures are within <tools></tools> XML tags:\n"
        f"<tools>\n{signatures}\n</tools>\n"
        "For each function call, return a JSON object with the function name and arguments "
        "within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in str(template)


def apply_tools(
    messages: list[dict[str, Any]], options: ChatOptions, tools: Sequence[FunctionTool],
    template: str | None,
) -> tuple[list[dict[str, Any]], ChatOptions]:
    """The messages and render options for ``tools``: a ``template`` (the one that will
    render) that knows tools gets them as its ``tools`` variable; any other, the default
    Hermes rendering in the messages (:func:`render_tool_messages`)."""
    if template_knows_tools(template):
        return messages, replace(options, tools=[t.as_openai() for t in tools] or None)
    return render_tool_messages(messages, tools), options


def render_tool_messages(
    messages: list[dict[str, Any]], tools: Sequence[FunctionTool]
) -> list[dict[str, Any]]:
    """The default rendering: tool prompt in the system message, calls and results as text."""
    rendered = [_as_text(m) for m in messages]
    if not tools:
        return rendered
    prompt = default_tool_prompt(tools)
    if rendered and rendered[0].get("role") == "system":
        first = dict(rendered[0])
        first["content"] = f"{_text(first.get('content'))}\n\n{prompt}".lstrip()
        return [first, *rendered[1:]]
    return [{"role": "system", "content": prompt}, *rendered]


def _as_text(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if message.get("role") == "assistant" and calls:
        blocks = [_call_block(call) for call in calls]
        content = "\n".join(filter(None, [_text(message.get("content")), *blocks]))
        return {**message, "content": content}
    if message.get("role") == "tool":
        return {
            **message,
            "content": f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>",
        }
    return message


def _text(content: Any) -> str:
    if isinstance(content, list):  # text parts, as chat_utils joins them
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return "" if content is None else str(content)


def _call_block(call: Any) -> str:
    function = call.get("function", {}) if isinstance(call, Mapping) else {}
    arguments = function.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        pass  # kept as the client sent it
    body = json.dumps({"name": function.get("name"), "arguments": arguments})
    return f"{OPEN_TAG}\n{body}\n{CLOSE_TAG}"
