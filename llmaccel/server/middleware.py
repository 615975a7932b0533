"""ASGI middleware of the server: request ids and the last line against bugs, the request-body limit
and the request counter.

All are plain ASGI (not Starlette's BaseHTTPMiddleware), so streaming responses pass through
untouched and a client's disconnect still reaches the app.
"""

from __future__ import annotations

import logging
import uuid

from llmaccel.server.errors import APIError
from llmaccel.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

COUNTED_PATHS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/version", "/metrics"}


class CatchErrors:
    """Gives every HTTP request an id (`x-request-id` on the response, `request_id` in the ASGI scope's
    state) and turns an exception no handler took into a 500 that says "internal error" and that id,
    with the traceback logged once under the same id. The exception is not raised further, so the
    server keeps the client's keep-alive connection (Starlette's own last handler re-raises, and
    uvicorn then drops the connection)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = "req-" + uuid.uuid4().hex[:24]
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            logger.exception("internal error in %s %r (request %s)", scope["method"], scope["path"][:200], request_id)
            if not started:
                error = APIError(500, f"internal error (request {request_id}); the server log has the details",
                                 "internal_error", code="internal_error")
                await error.response()(scope, receive, send_with_id)


class LimitBody:
    """ASGI middleware answering 413 to a request body over `max_bytes`, by its Content-Length or, when it
    is sent in chunks, as soon as the bytes received pass the limit, and 400 to one that is not UTF-8.
    A body within it is read whole and handed on; later receive() calls (disconnect watching) go to
    the client as before."""

    def __init__(self, app, max_bytes: int, metrics: ServerMetrics) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            self.metrics.rejected.labels(reason="invalid_request").inc()
            error = APIError(400, f"the request body is not valid UTF-8 (byte 0x{body[exc.start]:02x} at offset "
                             f"{exc.start}); send JSON encoded as UTF-8", code="invalid_utf8")
            await error.response()(scope, receive, send)
            return
        pending = [{"type": "http.request", "body": body, "more_body": False}]

        async def replay():
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send) -> None:
        self.metrics.rejected.labels(reason="too_large").inc()
        error = APIError(413, f"the request body is larger than this server accepts ({self.max_bytes} bytes, "
                         "--max-body-size)", code="request_too_large")
        await error.response()(scope, receive, send)


class CountRequests:
    """ASGI middleware counting answered requests by endpoint and status (streaming-safe)."""

    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_and_note(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            path = scope["path"] if scope["path"] in COUNTED_PATHS else "other"
            self.metrics.requests.labels(endpoint=path, status=str(status)).inc()
