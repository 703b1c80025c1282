"""Request fields that constrain the output -> the engine's :class:`StructuredOutputsParams`.

- OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type":
  "json_object"}`` (any JSON object) or ``{"type": "json_schema", "json_schema": {"name",
  "schema", "strict"}}`` (JSON matching ``schema``; without a schema, any JSON object).
  ``strict`` is accepted either way: the grammar always enforces the whole schema.
- vLLM's ``structured_outputs``: ``{"json" | "regex" | "choice" | "grammar" |
  "json_object": ..., "disable_any_whitespace": bool}``, as ``StructuredOutputsParams``.

At most one of the two may be set. A malformed field, or a schema, regex or grammar that
cannot compile, is a 400 naming the field the client set (checked here in milliseconds,
without the tokenizer, so a bad constraint never reaches the engine).
"""

from __future__ import annotations

from typing import Any

from inflight.entrypoints.openai.errors import OpenAIError, bad_request
from inflight.sampling_params import StructuredOutputsParams


def structured_outputs_of(
    response_format: dict[str, Any] | None,
    structured_outputs: dict[str, Any] | None,
    format_param: str = "response_format",
) -> StructuredOutputsParams | None:
    """The constraint a request asks for, validated, or None; 400s name the field.

    ``format_param`` is what the client called ``response_format`` (the Responses API's
    ``text.format`` is the same object, flattened there by the caller)."""
    from_format = _from_response_format(response_format, format_param)
    if structured_outputs is None:
        return from_format
    if from_format is not None:
        raise bad_request(
            f"Set either {format_param} or structured_outputs, not both.", "structured_outputs"
        )
    return checked(
        lambda: StructuredOutputsParams.from_dict(structured_outputs), "structured_outputs"
    )


def checked(build: Any, param: str, what: str | None = None) -> StructuredOutputsParams:
    """``build()``'s params once their grammar is known to compile; a 400 naming ``param``
    (its message says "Invalid ``what``", by default ``param``)."""
    from inflight.structured_output.grammar import validate_grammar  # imports llguidance

    try:
        params: StructuredOutputsParams = build()
        validate_grammar(params)
    except ValueError as error:  # InvalidRequestError included
        message = str(error).removeprefix("StructuredOutputsParams: ")
        raise bad_request(f"Invalid {what or param}: {message}", param) from error
    return params


def _from_response_format(
    response_format: dict[str, Any] | None, param: str
) -> StructuredOutputsParams | None:
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise _bad_format(param, "json_schema must be an object with a string 'name'")
        schema = spec.get("schema")
        if schema is None:
            return StructuredOutputsParams(json_object=True)
        if not isinstance(schema, dict):
            raise _bad_format(param, "json_schema.schema must be a JSON schema object")
        return checked(lambda: StructuredOutputsParams(json=schema), param)
    if kind == "structural_tag":
        raise OpenAIError(
            400,
            f"'{param}' of type 'structural_tag' is not supported by this server.",
            param=param,
            code="unsupported_parameter",
        )
    raise _bad_format(
        param, f"type must be one of 'text', 'json_object', 'json_schema', got {kind!r}"
    )


def _bad_format(param: str, message: str) -> OpenAIError:
    return bad_request(f"Invalid {param}: {message}.", param)
