"""The served OpenAPI schema (`/openapi.json`, behind the key like every route but /health),
made true to what the server answers: FastAPI documents a 422 for a body that fails
validation, this server answers 400 in OpenAI's error shape (`app.py`); it also answers
401 without the key, 413 past the body limit, 404 for an unknown model and 503 on a full
queue, and streams `text/event-stream` when asked."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
REFUSALS = {
    "400": "The body is not a valid request, or asks for what the server cannot honour",
    "401": "No API key, or a wrong one (with --api-key)",
    "404": "No such model",
    "413": "The body is larger than the server reads",
    "503": "The queue is full (Retry-After) or the server is stopping",
}


def served_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema of `app`, with its responses as the server gives them."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path, operations in schema.get("paths", {}).items():
            for operation in operations.values() if path != "/health" else ():
                _true_responses(operation, streams=path.endswith("completions"))
        schema.get("components", {}).get("schemas", {}).pop("HTTPValidationError", None)
        schema.get("components", {}).get("schemas", {}).pop("ValidationError", None)
        app.openapi_schema = schema
    return app.openapi_schema


def _true_responses(operation: dict[str, Any], streams: bool) -> None:
    responses = operation.setdefault("responses", {})
    responses.pop("422", None)
    for code, text in REFUSALS.items():
        responses[code] = {"description": text, "content": {"application/json": {"schema": ERROR}}}
    if streams and "requestBody" in operation:
        ok = responses.setdefault("200", {"description": "The completion"})
        # Server-sent events: each `data:` line a chunk object, the last `[DONE]` (no one
        # JSON schema describes the stream as a whole).
        ok.setdefault("content", {})["text/event-stream"] = {"schema": {}}
