"""Twenty JSON schemas of varied shape for the structured-output tests."""

from __future__ import annotations

from typing import Any

_INT = {"type": "integer", "minimum": -1000, "maximum": 1000}


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object", "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


SCHEMAS: dict[str, dict[str, Any]] = {
    "person": _obj({"name": {"type": "string", "maxLength": 20},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "enum": _obj({"color": {"enum": ["red", "green", "blue"]}}),
    "number-bounds": _obj({"temperature": {"type": "number", "minimum": -50, "maximum": 60}}),
    # Arrays at the top level invite runs of whitespace from this small model under
    # flexible whitespace (vLLM's default too): the tests disable it for these two.
    "int-array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                  "minItems": 1, "maxItems": 5},
    "nested": _obj({"user": _obj({
        "id": _INT,
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
    })}),
    "booleans": _obj({"done": {"type": "boolean"}, "urgent": {"type": "boolean"}}),
    "optional": _obj({"title": {"type": "string", "maxLength": 10},
                      "pages": {"type": "integer", "minimum": 1, "maximum": 999}},
                     required=["title"]),
    "zip-pattern": _obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    "array-of-objects": _obj({"items": {
        "type": "array", "maxItems": 2,
        "items": _obj({"sku": {"type": "string", "maxLength": 8},
                       "qty": {"type": "integer", "minimum": 1, "maximum": 10}}),
    }}),
    "top-level-enum": {"type": "string", "enum": ["yes", "no", "maybe"]},
    "top-level-int": {"type": "integer", "minimum": 1, "maximum": 100},
    "date-pattern": _obj({"date": {"type": "string",
                                   "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
    "const": _obj({"version": {"const": "1.0"}, "ok": {"type": "boolean"}}),
    "any-of": _obj({"value": {"anyOf": [_INT, {"type": "string", "maxLength": 5}]}}),
    "nullable": _obj({"middle_name": {"type": ["string", "null"], "maxLength": 10}}),
    "exclusive-bounds": _obj({"ratio": {"type": "number", "exclusiveMinimum": 0,
                                        "exclusiveMaximum": 1}}),
    "prefix-items": {"type": "array", "items": False,
                     "prefixItems": [{"type": "string", "maxLength": 6}, _INT]},
    "matrix": _obj({"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": _INT}}}),
    "defs-ref": {
        "$defs": {"point": _obj({"x": _INT, "y": _INT})},
        **_obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}),
    },
    "fixed-length": _obj({"code": {"type": "string", "minLength": 3, "maxLength": 3,
                                   "pattern": "^[A-Z]+$"},
                          "tags": {"type": "array", "maxItems": 2,
                                   "items": {"enum": ["new", "sale"]}}}),
}


NO_WHITESPACE = {"int-array", "prefix-items"}
