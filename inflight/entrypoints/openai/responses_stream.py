"""A Responses answer as OpenAI's typed server-sent events (``stream: true``).

Each event is an ``event: <type>`` line and a ``data:`` line whose ``sequence_number``
counts from 0::

    response.created  response.in_progress
    per output item:  response.output_item.added
        a message:    response.content_part.added  response.output_text.delta (per piece
                      of text)  response.output_text.done  response.content_part.done
        a call:       response.function_call_arguments.delta  ...arguments.done
                      response.output_item.done
    response.completed                 (or, when the engine fails: error, response.failed)

As in vLLM, the last event is ``response.completed`` even for a response cut by
``max_output_tokens`` (its ``status`` says ``incomplete``; OpenAI sends
``response.incomplete`` there), so the client's ``get_final_response()`` works for both.
No ``data: [DONE]`` line follows, as from OpenAI and vLLM.

Each output item is finished before the next is added, as OpenAI sends them; the items
end up as the unstreamed answer's ``output`` for the same text.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic_core import to_json

from inflight.engine.request_stream import EngineDeadError, RequestStream, StreamDroppedError
from inflight.entrypoints.openai.protocol import ChatTokenLogprob
from inflight.entrypoints.openai.protocol_responses import (
    FunctionCall,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseError,
    ResponseUsage,
)
from inflight.entrypoints.openai.serving import stream_failure

if TYPE_CHECKING:  # the reply's module imports this one
    from inflight.entrypoints.openai.serving_responses import ResponseReply


def response_status(finish_reason: str | None) -> str:
    """The response's status: cut by the token limit (or the context) is incomplete;
    aborted by the server (shutting down) is cancelled."""
    return {"length": "incomplete", "abort": "cancelled"}.get(finish_reason or "", "completed")


def item_status(finish_reason: str | None) -> str:
    """An output item's status: cut short (the token limit, an abort) is incomplete."""
    return "incomplete" if finish_reason in ("length", "abort") else "completed"


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"



class _Events:
    """OpenAI's typed server-sent events, numbered in the order they are sent."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {to_json(body).decode()}\n\n"


@dataclass(slots=True)
class _StreamedOutput:
    """A streamed response's output items, announced as the answer's text comes.

    The text streams into one message item, opened by its first piece; a tool call closes
    the message (complete) and opens a function_call item, whose arguments stream as they
    come (a named tool choice) or whole once parsed (auto, required). ``items`` ends up as
    the non-streamed answer's ``output`` for the same text.
    """

    reply: ResponseReply
    event: _Events
    items: list[OutputItem] = field(default_factory=list)
    message: OutputMessage | None = None  # while its text streams
    sent: list[ChatTokenLogprob] = field(default_factory=list)  # went out with the text
    unsent: list[ChatTokenLogprob] = field(default_factory=list)  # text not sent yet
    calls: dict[int, FunctionCall] = field(default_factory=dict)  # by the answer's index

    def add_logprobs(self, entries: list[ChatTokenLogprob] | None) -> None:
        """A delta's logprobs; they go out with the next piece of text (those of a tool
        call's tokens never do: the message closes before the call)."""
        self.unsent.extend(entries or [])

    def text(self, piece: str) -> Iterator[str]:
        """A piece of the message's text, with the logprobs of the tokens not sent yet
        (a token may add no text of its own: part of a character, a skipped special)."""
        if not piece:
            return
        if self.message is None:
            yield from self._open_message()
        yield self._delta(piece)

    def call(self, delta: dict[str, Any], status: str = "completed") -> Iterator[str]:
        """A chat tool-call delta (``tool_parsing.ToolCallStreamer``'s). A new call first
        closes the item before it (with ``status``), as OpenAI closes each item before
        adding the next."""
        index, function = delta["index"], delta["function"]
        call = self.calls.get(index)
        if call is None:
            if self.message is not None:
                yield from self._close_message("completed")
            yield from self._close_calls(status)
            call = FunctionCall(
                id=new_item_id("fc"), call_id=delta["id"], name=function["name"], arguments=""
            )
            self.calls[index] = call
            self.items.append(call)
            yield self.event("response.output_item.added", **self._index(call), item=call)
        if function.get("arguments"):
            call.arguments += function["arguments"]
            yield self.event(
                "response.function_call_arguments.delta",
                **self._where(call),
                delta=function["arguments"],
            )

    def finish(self, status: str) -> Iterator[str]:
        """Close what is open; an answer of nothing is an empty message, as unstreamed."""
        if not self.items:
            yield from self._open_message()
        if self.message is not None:
            if self.unsent:  # the last tokens added no text: their logprobs still go out
                yield self._delta("")
            yield from self._close_message(status)
        yield from self._close_calls(status)

    def _close_calls(self, status: str) -> Iterator[str]:
        for call in self.calls.values():
            if call.status != "in_progress":
                continue  # closed already
            call.status = status
            yield self.event(
                "response.function_call_arguments.done",
                **self._where(call),
                name=call.name,
                arguments=call.arguments,
            )
            yield self.event("response.output_item.done", **self._index(call), item=call)

    def _open_message(self) -> Iterator[str]:
        logprobs: list[ChatTokenLogprob] | None = (
            [] if self.reply.params.logprobs is not None else None
        )
        message = OutputMessage(id=new_item_id("msg"))
        self.items.append(message)
        yield self.event("response.output_item.added", **self._index(message), item=message)
        message.content.append(OutputText(text="", logprobs=logprobs))
        yield self.event(
            "response.content_part.added",
            **self._where(message),
            content_index=0,
            part=message.content[0],
        )
        self.message = message

    def _delta(self, piece: str) -> str:
        message = self.message
        assert message is not None
        message.content[0].text += piece
        event = self.event(
            "response.output_text.delta",
            **self._where(message),
            content_index=0,
            delta=piece,
            logprobs=self.unsent,
        )
        self.sent.extend(self.unsent)
        self.unsent = []
        return event

    def _close_message(self, status: str) -> Iterator[str]:
        message, self.message = self.message, None
        assert message is not None
        part = message.content[0]
        if part.logprobs is not None:
            part.logprobs = list(self.sent)
        where = {**self._where(message), "content_index": 0}
        yield self.event(
            "response.output_text.done", **where, text=part.text, logprobs=part.logprobs or []
        )
        yield self.event("response.content_part.done", **where, part=part)
        message.status = status
        yield self.event("response.output_item.done", **self._index(message), item=message)

    def _index(self, item: OutputItem) -> dict[str, int]:
        return {"output_index": self.items.index(item)}

    def _where(self, item: OutputItem) -> dict[str, Any]:
        return {"item_id": item.id, **self._index(item)}


async def stream_response(reply: ResponseReply, stream: RequestStream) -> AsyncIterator[str]:
    event = _Events()
    output = _StreamedOutput(reply, event)
    started = reply.response("in_progress")
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    streamer = reply.streamer()
    finish_reason: str | None = None
    usage = ResponseUsage.of(0, 0, 0)
    try:
        async for delta in stream:
            output.add_logprobs(reply.logprobs(delta.token_ids, delta.logprobs))
            content, calls = streamer.feed(delta.text)
            if delta.finish_reason is not None:
                finish_reason = delta.finish_reason
                rest, more = streamer.finish()
                content, calls = content + rest, calls + more
            for piece in output.text(content):
                yield piece
            for call in calls:
                for piece in output.call(call, item_status(finish_reason)):
                    yield piece
            usage = ResponseUsage.of(
                delta.num_prompt_tokens, delta.num_output_tokens, delta.num_cached_tokens
            )
        for piece in output.finish(item_status(finish_reason)):
            yield piece
        final = reply.response(response_status(finish_reason), output.items, usage)
        yield event("response.completed", response=final)
    except (EngineDeadError, StreamDroppedError) as error:
        failure = stream_failure(error)
        yield event("error", code=failure.code, message=failure.message, param=failure.param)
        code = failure.code or ("server_error" if failure.status >= 500 else failure.type)
        failed = ResponseError(code=code, message=failure.message)
        yield event("response.failed", response=reply.response("failed", output.items, error=failed))
    finally:
        stream.close()
