"""From a request's :class:`StructuredOutputsParams` to an llguidance grammar.

No torch here. ``serialize_grammar`` turns each constraint into llguidance's grammar text;
``validate_grammar`` checks it without the tokenizer (milliseconds), so a bad schema,
regex or grammar is rejected when the request is made, as an ``InvalidRequestError``
naming ``structured_outputs``.
"""

from __future__ import annotations

import json

import llguidance

from inflight.sampling_params import InvalidRequestError, StructuredOutputsParams

_ANY_OBJECT = {"type": "object"}


def serialize_grammar(params: StructuredOutputsParams) -> str:
    """llguidance's grammar text for the one constraint set in ``params``."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = params.json if kind == "json" else _ANY_OBJECT
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema,  # type: ignore[arg-type]
            defaults={"whitespace_flexible": not params.disable_any_whitespace},
        )
    if kind == "regex":
        return llguidance.grammar_from("regex", params.regex)  # type: ignore[arg-type]
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(params.choice))
    # Lark, or GBNF (llama.cpp's syntax) converted to Lark.
    return llguidance.grammar_from("grammar", params.grammar)  # type: ignore[arg-type]


def validate_grammar(params: StructuredOutputsParams) -> str:
    """The serialized grammar; raises InvalidRequestError if it cannot compile."""
    try:
        grammar = serialize_grammar(params)
    except (ValueError, TypeError, KeyError) as error:
        raise _invalid(params, str(error)) from error
    message = llguidance.LLMatcher.validate_grammar(grammar, None)
    if message:
        raise _invalid(params, message)
    return grammar


def _invalid(params: StructuredOutputsParams, message: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"StructuredOutputsParams: invalid {params.kind}: {message}", "structured_outputs"
    )
