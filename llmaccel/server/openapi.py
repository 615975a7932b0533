"""The OpenAPI document as the server behaves: the error model on every status it sends, no 422
(a body that does not validate gets a 400), /metrics as text/plain, streams as text/event-stream."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from llmaccel.server.response_models import ErrorResponse

_WHEN = {
    400: "A field of the wrong type or out of range, malformed JSON, an unknown model, a prompt over the context "
         "window, a blocked prompt (code content_filter) or an unsupported field; the error names it.",
    401: "--api-key is set and the Bearer token is missing or wrong.",
    404: "No such result file under --ui-results-dir (or the server has none).",
    413: "The request body is larger than --max-body-size.",
    429: "A rate limit, a full waiting queue, or too many failed authentications from this address; see "
         "Retry-After.",
    500: "A bug in llmaccel; the message names the request id under which the server log has the details.",
    503: "The model is loading, the server is draining, or the engine stopped; see Retry-After.",
    504: "The request passed --request-timeout and was aborted.",
}

STREAM = {"text/event-stream": {"schema": {"type": "string", "description": "Server-sent events: one JSON chunk "
                                           "per data line, then `data: [DONE]`."}}}
TEXT = {"text/plain": {"schema": {"type": "string"}}}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses` entries for these error statuses, each with OpenAI's error model."""
    return {status: {"model": ErrorResponse, "description": _WHEN[status]} for status in statuses}


def openapi_schema(app: FastAPI, model_names: tuple[str, ...] = ()) -> dict[str, Any]:
    """FastAPI's document without the 422 it adds to every route with a body, and with the names of
    the served models as the only values `model` takes."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        models = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            models.pop(name, None)
        for name in ("ChatCompletionRequest", "CompletionRequest"):
            if model_names and name in models:
                models[name]["properties"]["model"] = {
                    "anyOf": [{"type": "string", "enum": list(model_names)}, {"type": "null"}], "default": None,
                    "description": "A served model's name; null or absent: the first."}
        app.openapi_schema = schema
    return app.openapi_schema
