"""RequestStream: the outputs of one engine request, in order, as an async iterator with a deadline.

Closing a stream before its request finished (the client went away) or passing its deadline aborts
the request inside the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

from llmaccel.errors import RequestTimeoutError
from llmaccel.outputs import RequestOutput


class StreamOwner(Protocol):
    """What a stream needs of its engine (engine/async_engine.py's AsyncEngine, which imports this
    module): the open streams by request id, and a way to abort one."""

    _streams: dict[str, RequestStream]

    def abort(self, request_id: str) -> None: ...


class Deadline:
    """Puts a RequestTimeoutError into a request's output queue when `deadline` (event-loop time; None:
    never) passes. One timer a request: a timeout around every wait for the next output cost ~10 us an
    output, 64 streams x every step of a full batch, on the event loop that also sends the chunks."""

    def __init__(self, queue: asyncio.Queue, deadline: float | None, request_id: str) -> None:
        self._timer = None if deadline is None else asyncio.get_running_loop().call_at(
            deadline, queue.put_nowait, RequestTimeoutError(
                f"request {request_id} passed its deadline and was aborted; "
                "raise --request-timeout or ask for fewer tokens"))

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


class RequestStream:
    """Outputs of one request, in order; iterate with `async for`. Closing it early aborts."""

    def __init__(self, engine: StreamOwner, request_id: str, deadline: float | None) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._deadline = Deadline(self._queue, deadline, request_id)  # deadline in event-loop time
        self.finished = False
        self.taken = 0  # outputs the reader has taken

    def _discard_untaken(self) -> None:
        """Drop outputs queued but not yet read (a replicated engine sends the request again)."""
        while not self._queue.empty():
            self._queue.get_nowait()

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    raise item
                self.finished = item.finished
                self.taken += 1
                yield item
        finally:
            self.close()

    def close(self) -> None:
        """Abort the request unless it finished; safe to call more than once."""
        self._deadline.cancel()
        if self._engine._streams.pop(self.request_id, None) is not None and not self.finished:
            self._engine.abort(self.request_id)
