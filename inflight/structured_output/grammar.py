"""From a request's :class:`StructuredOutputsParams` to an llguidance grammar.

No torch here. ``serialize_grammar`` turns each constraint into llguidance's grammar text;
``validate_grammar`` checks it without the tokenizer (milliseconds), so a bad schema,
regex or grammar is rejected when the request is made, as an ``InvalidRequestError``
naming ``structured_outputs``.
"""

from __future__ import annotations

from typing import Any

import llguidance

from inflight.sampling_params import InvalidRequestError, StructuredOutputsParams

_ANY_OBJECT = {"type": "object"}
# JSON whitespace between tokens, at most this much in a row: enough for pretty-printed
# JSON nested 15 deep, and an end to the runaway where a model that wants what the schema
# forbids (another key, say) writes whitespace until max_tokens instead.
BOUNDED_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,32}"


def serialize_grammar(params: StructuredOutputsParams) -> str:
    """llguidance's grammar text for the one constraint set in ``params``."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = params.json if kind == "json" else _ANY_OBJECT
        if kind == "json":
            schema = closed_objects(schema, every_object=params.disable_additional_properties)
        defaults: dict[str, Any] = {"whitespace_flexible": not params.disable_any_whitespace}
        if params.whitespace_pattern is not None:
            defaults["whitespace_pattern"] = params.whitespace_pattern
        elif not params.disable_any_whitespace:
            defaults["whitespace_pattern"] = BOUNDED_WHITESPACE
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema,  # type: ignore[arg-type]
            defaults=defaults,  # type: ignore[arg-type]
        )
    if kind == "regex":
        return llguidance.grammar_from("regex", params.regex)  # type: ignore[arg-type]
    if kind == "choice":
        # One regex alternation, not llguidance's choice grammar: that puts every choice
        # in one parser row, which holds at most 2000 items (and took 5 s for 50,000);
        # as a regex the lexer matches them all (50,000 in 0.25 s).
        options = "|".join(_regex_literal(choice) for choice in params.choice)  # type: ignore[union-attr]
        return llguidance.grammar_from("regex", f"(?:{options})")
    # Lark, or GBNF (llama.cpp's syntax) converted to Lark.
    return llguidance.grammar_from("grammar", params.grammar)  # type: ignore[arg-type]


# Where a JSON schema holds subschemas: one, a list of them, or a name -> schema map.
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
              "additionalItems", "unevaluatedItems", "unevaluatedProperties", "propertyNames")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema: Any, every_object: bool = False) -> Any:
    """A copy of a JSON schema where object schemas without ``additionalProperties`` get
    ``additionalProperties: false``: those that list ``properties`` (what vLLM's default
    xgrammar backend does, in its strict mode, and what OpenAI's ``strict`` means), or,
    with ``every_object``, also a bare ``{"type": "object"}`` (which then only allows
    ``{}``; vLLM's ``disable_additional_properties``)."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in _SUBSCHEMA:
        if key in closed:
            closed[key] = closed_objects(closed[key], every_object)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(closed.get(key), list):
            closed[key] = [closed_objects(item, every_object) for item in closed[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: closed_objects(sub, every_object)
                           for name, sub in closed[key].items()}
    lists_properties = "properties" in schema
    if (lists_properties or (every_object and schema.get("type") == "object")) and (
        "additionalProperties" not in schema
    ):
        closed["additionalProperties"] = False
    return closed


# Characters with a meaning in llguidance's regex syntax (Rust's), and the "/" that ends
# the Lark regex literal it is wrapped in.
_REGEX_META = set("\\.+*?()|[]{}^$#&-~/\"")


def _regex_literal(text: str) -> str:
    """A regex matching exactly ``text``: metacharacters escaped, control characters and
    whitespace other than a space as ``\\x{..}``."""
    out = []
    for char in text:
        if char in _REGEX_META:
            out.append("\\" + char)
        elif (char.isspace() and char != " ") or not char.isprintable():
            out.append(f"\\x{{{ord(char):x}}}")
        else:
            out.append(char)
    return "".join(out)


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
