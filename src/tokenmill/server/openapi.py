"""The request bodies in /openapi.json.

The POST routes read their bodies themselves (bounded in size and time by read_body, then parsed
by the pydantic models in protocol.py), so FastAPI cannot see what they accept and would publish
them without a request body. This adds each route's body schema, generated from the same models
that parse it, so clients and schema-driven fuzzers (schemathesis) know what to send.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from tokenmill.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from tokenmill.server.protocol_lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

# path -> the models one of which its POST body must be (/tokenize takes a prompt or messages).
REQUEST_BODIES: dict[str, tuple[type[BaseModel], ...]] = {
    "/v1/completions": (CompletionRequest,),
    "/v1/chat/completions": (ChatCompletionRequest,),
    "/tokenize": (TokenizeCompletionRequest, TokenizeChatRequest),
    "/detokenize": (DetokenizeRequest,),
    # Published only on servers that load adapters at runtime (--allow-runtime-lora-updating).
    "/v1/load_lora_adapter": (LoadLoRAAdapterRequest,),
    "/v1/unload_lora_adapter": (UnloadLoRAAdapterRequest,),
}
REF_TEMPLATE = "#/components/schemas/{model}"


def add_request_bodies(schema: dict[str, Any]) -> dict[str, Any]:
    """Puts the request body of every route in REQUEST_BODIES into an OpenAPI document (in place)."""
    published = {
        path: accepted
        for path, accepted in REQUEST_BODIES.items()
        if schema.get("paths", {}).get(path, {}).get("post") is not None
    }
    models = sorted({m for ms in published.values() for m in ms}, key=lambda m: m.__name__)
    refs, definitions = models_json_schema([(m, "validation") for m in models], ref_template=REF_TEMPLATE)
    schema.setdefault("components", {}).setdefault("schemas", {}).update(definitions.get("$defs", {}))
    for path, accepted in published.items():
        operation = schema["paths"][path]["post"]
        options = [refs[(m, "validation")] for m in accepted]
        body_schema = options[0] if len(options) == 1 else {"anyOf": options}
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": body_schema}},
        }
    return schema


def document_request_bodies(app: FastAPI) -> None:
    """Makes `app.openapi()` (and so /openapi.json) include the request bodies; built once, cached
    by FastAPI like the rest of the document."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = add_request_bodies(build())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
