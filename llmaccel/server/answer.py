"""One completion over HTTP: rate limits, submission, the cascade's route, then a stream or one response.

Every failure maps to OpenAI's error JSON: refusals before generation (400, 429, 503) and failures
after acceptance (a timeout 504, a failed request 500, a dead engine 503, a cascade's large model with
a full queue 429). A client that goes away mid-answer gets its engine requests aborted at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import suppress
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from llmaccel.config import ServerConfig
from llmaccel.errors import (
    ContentFilterError,
    EngineDeadError,
    EngineOverloadedError,
    PromptTooLongError,
    RequestFailedError,
    RequestTimeoutError,
)
from llmaccel.safety.output_guard import worst_verdict
from llmaccel.server import protocol as p
from llmaccel.server.errors import APIError
from llmaccel.server.job import prime_streams
from llmaccel.server.serving import OpenAIServing, error_info

if TYPE_CHECKING:
    from llmaccel.server.state import ServerState


class AnswerView(Protocol):
    """Another API's shape of a chat answer (server/responses_output.py: the Responses API's)."""

    def body(self, chat: dict[str, Any]) -> dict[str, Any]: ...  # a whole answer's body, from the chat completion's

    def stream(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]: ...  # SSE events, from the chat chunks'


async def answer(serving: OpenAIServing, body: p.ChatCompletionRequest | p.CompletionRequest, model: str,
                 request: Request, state: ServerState, view: AnswerView | None = None) -> Response:
    """`view`: the answer in another API's shapes (the Responses API's), on the same path."""
    limiter, client = state.rate_limiter, admitted_client(state, request)
    prompt_param = "messages" if hasattr(body, "messages") else "prompt"
    try:
        job = serving.submit(body, model, client)
    except (ValueError, EngineOverloadedError, EngineDeadError) as exc:
        raise submission_error(exc, prompt_param) from None
    if limiter is not None:
        limiter.charge(client, sum(job.prompt_lengths))
        job.on_done = lambda completion_tokens: limiter.charge(client, completion_tokens)
    cache_header = {"x-llmaccel-cache": job.cache}
    if body.stream:
        try:  # a cascade decides before the first byte, so its route can go in a header
            route = await serving.routes(job)
            if serving.guard_blocks:  # so does the semantic guard, with the first output
                await prime_streams(job)
        except ContentFilterError as exc:
            raise _filtered(exc, prompt_param) from None
        except (RequestTimeoutError, EngineDeadError, RequestFailedError, EngineOverloadedError) as exc:
            raise _failed(exc) from None
        if route is not None:
            cache_header["x-llmaccel-route"] = route
        events = serving.stream(job) if view is None else view.stream(serving.stream(job))
        return _SSEResponse(events, media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **cache_header})
    task = asyncio.create_task(serving.complete(job))
    watcher = asyncio.create_task(_disconnected(request))
    await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    if not task.done():  # the client went away: cancelling the task aborts its engine requests
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task
        return Response(status_code=499)
    try:
        response = task.result()
    except ContentFilterError as exc:
        raise _filtered(exc, prompt_param) from None
    except (RequestTimeoutError, EngineDeadError, RequestFailedError, EngineOverloadedError) as exc:
        raise _failed(exc) from None
    body, headers = response.model_dump(), dict(cache_header)
    if view is not None:
        body = view.body(body)
    if (route := await serving.routes(job)) is not None:  # decided already: the answer is there
        headers["x-llmaccel-route"] = route
    if job.guard_reports:  # the output guard's verdicts: a header for the worst, each choice's in the body
        headers["x-llmaccel-guard"] = worst_verdict(job.guard_reports)
        body["guard"] = [r.as_dict() for r in job.guard_reports]
    return JSONResponse(body, headers=headers)


def submission_error(exc: ValueError | EngineOverloadedError | EngineDeadError, prompt_param: str,
                     value_param: str | None = None, prefix: str = "") -> APIError:
    """The error response of a request refused before any of it was queued: the input filter's refusal and a
    prompt over the context window (both named by `prompt_param`), any other bad value (by the error's own
    param, else `value_param`), a full queue, a dead engine. `prefix` goes before a bad value's message (which
    input of several it was)."""
    if isinstance(exc, ContentFilterError):
        return _filtered(exc, prompt_param)
    if isinstance(exc, EngineOverloadedError):
        return _failed(exc)
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), "service_unavailable", code="engine_unavailable", rejected="unavailable")
    if isinstance(exc, PromptTooLongError):
        return APIError(400, prefix + str(exc), param=prompt_param, code="context_length_exceeded",
                        rejected="invalid_request")
    return APIError(400, prefix + str(exc), param=getattr(exc, "param", None) or value_param,
                    rejected="invalid_request")


def admitted_client(state: ServerState, request: Request) -> str:
    """Who sent the request (rate limits and the priority policy's fair share count against it); a 429 when it
    is over its rate limit."""
    limiter, client = state.rate_limiter, state.gate.client_id(request)
    if limiter is not None and (limited := limiter.admit(client)) is not None:
        state.metrics.rate_limited.labels(limit=limited.limit).inc()
        raise APIError(429, f"rate limit reached: this client may send {_limit_text(state.config, limited.limit)} "
                       f"per minute; retry in {limited.retry_after_header} s", "rate_limit_error",
                       code="rate_limit_exceeded", headers={"Retry-After": limited.retry_after_header},
                       rejected="rate_limited")
    return client


def _failed(exc: Exception) -> APIError:
    """The error response of a request whose engine request failed: a full queue (at submission, or for a
    cascade's large model only after the small one was unsure), a timeout, a failed or a dead engine."""
    if isinstance(exc, EngineOverloadedError):
        return APIError(429, str(exc), "rate_limit_error", code="queue_full", headers={"Retry-After": "1"},
                        rejected="queue_full")
    info = error_info(exc)
    status = 504 if isinstance(exc, RequestTimeoutError) else 500 if isinstance(exc, RequestFailedError) else 503
    return APIError(status, info.message, info.type, code=info.code)


def _filtered(exc: ContentFilterError, param: str) -> APIError:
    """400 content_filter: the input filter's rules refused the prompt, or the semantic guard did."""
    return APIError(400, str(exc), param=param, code="content_filter", rejected="content_filter")


def _limit_text(config: ServerConfig, limit: str) -> str:
    return (f"{config.rate_limit_requests} requests" if limit == "requests"
            else f"{config.rate_limit_tokens} tokens")


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _SSEResponse(StreamingResponse):
    """Closes its generator however the response ends, so a vanished client's requests are aborted now."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with suppress(Exception):
                await self.body_iterator.aclose()
