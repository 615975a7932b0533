"""OpenAI-style HTTP errors: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fastapi.responses import JSONResponse

from llmaccel.bounds import RANGES
from llmaccel.server.response_models import ErrorInfo, ErrorResponse

_ROLES = {"system", "developer", "user", "assistant", "tool"}
_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


class APIError(Exception):
    """An error answer. `rejected` names the reason when the request was refused before generation
    (counted once, in the app's handler, as llmaccel_rejected_requests_total{reason})."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None,
                 rejected: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = dict(headers or {})
        self.rejected = rejected

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info).model_dump(), status_code=self.status,
                            headers=self.headers)


def validation_error_message(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """A message that names the offending field, from pydantic's error list; and that field."""
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # Drop union-branch names such as 'str' / 'list[int]' that pydantic puts into locations.
    loc = [part for part in loc if not any(c in part for c in "[]") and part not in ("str", "int", "float", "bool")]
    # a message's role picks its kind, and pydantic puts the role into the location: messages.0.user.content
    loc = [part for i, part in enumerate(loc) if not (i >= 2 and loc[i - 2] == "messages" and part in _ROLES)]
    field = ".".join(loc)
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "missing":
        message = "this field is required"
    elif first.get("type") in _RANGE_ERRORS and field in RANGES:  # the range as the table states it
        message = f"must be {RANGES[field].at_api().text}"
    elif first.get("type") == "finite_number":
        message = "must be a finite number"
    elif first.get("type") == "model_attributes_type" and not field:
        return "the request body must be a JSON object", None
    if "input" in first and first.get("type") != "missing" and not isinstance(first["input"], dict | list):
        message += f" (got {clip(repr(first['input']))})"
    extra = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    param = loc[0] if loc else None
    return (f"{field}: {message}{extra}" if field else f"{message}{extra}"), param


def clip(text: str, limit: int = 80) -> str:
    """Client-supplied text cut to `limit` characters for a message or a log line."""
    return text if len(text) <= limit else text[:limit] + "..."
