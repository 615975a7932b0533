"""RequestStream: the outputs of one engine request, in order, as an async iterator with a deadline.

Closing a stream before its request finished (the client went away) or passing its deadline aborts
the request inside the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from llmaccel.errors import RequestTimeoutError
from llmaccel.outputs import RequestOutput

if TYPE_CHECKING:
    from llmaccel.engine.async_engine import AsyncEngine


async def next_before_deadline(queue: asyncio.Queue, deadline: float | None, request_id: str):
    """The next item of a request's output queue, or RequestTimeoutError once `deadline` (event-loop
    time; None: never) has passed."""
    try:
        async with asyncio.timeout_at(deadline):
            return await queue.get()
    except TimeoutError:
        raise RequestTimeoutError(f"request {request_id} passed its deadline and was aborted; "
                                  "raise --request-timeout or ask for fewer tokens") from None


class RequestStream:
    """Outputs of one request, in order; iterate with `async for`. Closing it early aborts."""

    def __init__(self, engine: AsyncEngine, request_id: str, deadline: float | None) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._deadline = deadline  # in event-loop time
        self.finished = False

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await next_before_deadline(self._queue, self._deadline, self.request_id)
                if isinstance(item, BaseException):
                    raise item
                self.finished = item.finished
                yield item
        finally:
            self.close()

    def close(self) -> None:
        """Abort the request unless it finished; safe to call more than once."""
        if self._engine._streams.pop(self.request_id, None) is not None and not self.finished:
            self._engine.abort(self.request_id)
