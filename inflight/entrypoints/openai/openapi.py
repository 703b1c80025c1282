"""The published OpenAPI schema (``/openapi.json``) describes the real request bodies.

The generation routes read the raw request (strict parsing, OpenAI-shaped errors), so
FastAPI cannot infer their bodies; :func:`request_body` declares each route's pydantic
model as its body and :func:`install_request_schemas` adds those models to the schema's
components, as vLLM publishes its request models.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's ``openapi_extra``: a required JSON body described by ``model``."""
    schema = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install_request_schemas(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Put ``models`` (and the models they use) in the schema's components."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()  # FastAPI's; cached in app.openapi_schema, extended in place
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in models:
            model_schema = model.model_json_schema(ref_template=_REF)
            for name, definition in model_schema.pop("$defs", {}).items():
                components.setdefault(name, definition)
            components[model.__name__] = model_schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
