"""Tool calls in a chat answer: parsing the whole answer and streaming it as deltas.

The request side (``tools``, ``tool_choice``, their grammar and rendering) is
``tool_calls.py``; this module reads what the model wrote under that choice:

- a required answer is a JSON array of ``{"name", "arguments"}`` calls, a named one the
  arguments object itself (both enforced by the grammar, so they parse unless cut short);
- an auto answer holds Hermes ``<tool_call>{...}</tool_call>`` blocks after its content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from inflight.entrypoints.openai.tool_calls import OPEN_TAG, FunctionTool, ToolChoice

# A required answer's call (an item of tool_constraint's array) whose name is complete
# (names are 1-64 of [A-Za-z0-9_-], so need no escapes), and what may follow it in an
# answer cut short.
_REQUIRED_NAME = re.compile(
    r'\s*\{\s*"name"\s*:\s*"(?P<name>[A-Za-z0-9_-]{1,64})"\s*(?P<rest>.*)', re.DOTALL
)
_ARGUMENTS = re.compile(r'"arguments"\s*:\s*(?P<arguments>.*)', re.DOTALL)
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
# Between a required answer's calls: whitespace and the comma.
_BETWEEN_CALLS = re.compile(r"\s*,?\s*")
_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def constrained_calls(text: str, choice: ToolChoice) -> list[ToolCall]:
    """The calls in a required/named answer.

    An answer cut short (``max_tokens``, finish reason ``length``) still holds its calls,
    the last with the arguments as generated so far (incomplete JSON), as OpenAI answers
    and as the named choice streams them; a required answer cut before its first
    function's name is complete has no call ([]).
    """
    if choice.mode == "named":  # the text is the arguments: sent as generated, as streamed
        assert choice.name is not None
        return [ToolCall(choice.name, text, new_call_id())]
    body = text.lstrip()
    if not body.startswith("["):
        return []
    calls: list[ToolCall] = []
    at = 1
    while True:
        at = _BETWEEN_CALLS.match(body, at).end()  # type: ignore[union-attr]
        if at >= len(body) or body[at] == "]":
            return calls
        try:
            value, at = _DECODER.raw_decode(body, at)
        except ValueError:  # the answer was cut inside this call
            return calls + _cut_required_call(body[at:])
        calls.append(
            ToolCall(value["name"], _arguments_json(value["arguments"]), new_call_id())
        )


def _cut_required_call(text: str) -> list[ToolCall]:
    """The call of a required answer cut short: its name once complete, and the arguments
    generated so far ("" while the ``"arguments"`` key is still being written)."""
    head = _REQUIRED_NAME.match(text)
    if head is None:
        return []
    rest = head["rest"].removeprefix(",").lstrip()
    body = _ARGUMENTS.match(rest)
    if body is not None:
        return [ToolCall(head["name"], body["arguments"], new_call_id())]
    if '"arguments"'.startswith(rest.rstrip()):
        return [ToolCall(head["name"], "", new_call_id())]
    return []


def _arguments_json(arguments: Any) -> str:
    """A call's arguments as JSON text, characters as written (vLLM's parsers and OpenAI
    send UTF-8, not ``\\u`` escapes)."""
    return json.dumps(arguments, ensure_ascii=False)


def parse_hermes(text: str, tools: Sequence[FunctionTool]) -> tuple[str | None, list[ToolCall]]:
    """``(content, calls)`` of an auto answer; text stays content if no block parses."""
    start = text.find(OPEN_TAG)
    if start < 0:
        return text, []
    known = {t.name for t in tools}
    calls: list[ToolCall] = []
    for block in _BLOCK.findall(text[start:]):
        try:
            value = json.loads(block)
        except ValueError:
            continue
        if not isinstance(value, dict) or value.get("name") not in known:
            continue
        arguments = value.get("arguments", {})
        calls.append(ToolCall(value["name"], _arguments_json(arguments), new_call_id()))
    if not calls:
        return text, []
    # The text before the first call, as it streams (vLLM's Hermes parser: not stripped).
    content = text[:start]
    return content or None, calls


def safe_content_end(text: str) -> int:
    """How much of a streamed auto answer is surely content: up to a (possible) ``<tool_call>``."""
    start = text.find(OPEN_TAG)
    if start >= 0:
        return start
    for size in range(min(len(OPEN_TAG) - 1, len(text)), 0, -1):
        if OPEN_TAG.startswith(text[-size:]):
            return len(text) - size
    return len(text)


@dataclass(frozen=True, slots=True)
class ToolAnswer:
    """A chat answer seen through the request's tool choice."""

    content: str | None
    calls: list[ToolCall]


def parse_answer(
    text: str, tools: Sequence[FunctionTool], choice: ToolChoice, parallel: bool = True
) -> ToolAnswer:
    """The whole answer's content and tool calls (no calls: all of it is content)."""
    if choice.mode == "none":
        return ToolAnswer(text, [])
    if choice.constrained:
        # Only calls: an answer cut before its first call's name is complete has neither
        # calls nor content (the grammar's JSON is not the model's words).
        return ToolAnswer(None, constrained_calls(text, choice))
    content, calls = parse_hermes(text, tools)
    return ToolAnswer(content, calls if parallel else calls[:1])


class ToolCallStreamer:
    """Turns a streamed answer's text deltas into OpenAI's content and tool-call deltas.

    * named choice: the answer is the arguments, so they stream as they come (the first
      delta names the call);
    * required: the calls are sent whole when the answer ends (each name comes first in
      the text, its arguments after, so nothing could be sent earlier without a JSON
      parser);
    * auto: text streams as content up to a (possible) ``<tool_call>``; what follows is
      parsed when the answer ends.
    """

    def __init__(
        self, tools: Sequence[FunctionTool], choice: ToolChoice, parallel: bool = True
    ) -> None:
        self.tools, self.choice, self.parallel = tools, choice, parallel
        self.text = ""
        self.sent = 0  # characters of text already sent as content (auto)
        self.named_id = new_call_id() if choice.mode == "named" else None
        self.has_calls = False

    def feed(self, piece: str) -> tuple[str, list[dict[str, Any]]]:
        """The content and tool-call deltas to send for the next piece of text."""
        self.text += piece
        if self.choice.mode == "none":
            return piece, []
        if self.named_id is not None:
            if not piece and self.has_calls:
                return "", []
            first = not self.has_calls
            self.has_calls = True
            function: dict[str, Any] = {"arguments": piece}
            call: dict[str, Any] = {"index": 0, "function": function}
            if first:
                function["name"] = self.choice.name
                call.update(id=self.named_id, type="function")
            return "", [call]
        if self.choice.mode == "required":
            return "", []
        end = max(self.sent, safe_content_end(self.text))
        content, self.sent = self.text[self.sent : end], end
        return content, []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is left to send once the answer is complete."""
        if self.choice.mode == "none" or self.named_id is not None:
            return "", []
        answer = parse_answer(self.text, self.tools, self.choice, self.parallel)
        if not answer.calls:
            rest = "" if self.choice.constrained else self.text[self.sent :]
            self.sent = len(self.text)
            return rest, []
        self.has_calls = True
        return "", [call.as_openai(index) for index, call in enumerate(answer.calls)]
