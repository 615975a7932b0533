"""Result-cache hits and single-flight misses, as streams with RequestStream's interface.

A hit replays the stored outputs, so a streamed answer arrives in the same chunks as when it was
computed. A miss runs one engine request as a SharedFlight that every identical request arriving
while it runs subscribes to (single-flight): each subscriber sees every output from the first. The
engine request is aborted only when its last subscriber leaves, and its result is stored only when
it ends normally (stop or length).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from llmaccel.cache.result_cache import ResultCache
from llmaccel.engine.request_stream import Deadline, RequestStream
from llmaccel.errors import RequestTimeoutError
from llmaccel.outputs import RequestOutput


class ReplayStream:
    """A cache hit: the stored outputs, one by one."""

    def __init__(self, request_id: str, outputs: list[RequestOutput]) -> None:
        self.request_id, self._outputs = request_id, outputs
        self.finished = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        for output in self._outputs:
            self.finished = output.finished
            yield output

    def close(self) -> None:
        pass


class SharedFlight:
    def __init__(self, key: str, stream: RequestStream, cache: ResultCache,
                 flights: dict[str, SharedFlight]) -> None:
        self.key, self.stream, self.cache, self.flights = key, stream, cache, flights
        self.outputs: list[RequestOutput] = []
        self.error: BaseException | None = None
        self.done = False
        self._subscribers: set[FlightSubscriber] = set()
        flights[key] = self
        self._task = asyncio.get_running_loop().create_task(self._pump())

    def subscribe(self, request_id: str, timeout: float | None) -> FlightSubscriber:
        subscriber = FlightSubscriber(self, request_id, timeout)
        self._subscribers.add(subscriber)
        for output in self.outputs:
            subscriber.queue.put_nowait(output)
        if self.done:
            subscriber.queue.put_nowait(None)
        return subscriber

    async def _pump(self) -> None:
        try:
            async for output in self.stream:
                self.outputs.append(output)
                for subscriber in self._subscribers:
                    subscriber.queue.put_nowait(output)
            last = self.outputs[-1] if self.outputs else None
            if last is not None and last.finished and all(c.finish_reason in ("stop", "length")
                                                          for c in last.outputs):
                self.cache.put(self.key, self.outputs)
        except Exception as exc:  # a timeout or a dead engine: every subscriber hears of it
            self.error = exc
        finally:
            self.done = True
            if self.flights.get(self.key) is self:
                del self.flights[self.key]
            for subscriber in self._subscribers:
                subscriber.queue.put_nowait(None)

    def leave(self, subscriber: FlightSubscriber) -> None:
        self._subscribers.discard(subscriber)
        if not self._subscribers and not self.done:  # nobody wants it any more: abort the engine request
            if self.flights.get(self.key) is self:
                del self.flights[self.key]
            self._task.cancel()


class FlightSubscriber:
    """One request's view of a SharedFlight, with its own deadline."""

    def __init__(self, flight: SharedFlight, request_id: str, timeout: float | None) -> None:
        self.flight, self.request_id = flight, request_id
        self.queue: asyncio.Queue[RequestOutput | RequestTimeoutError | None] = asyncio.Queue()
        loop_time = asyncio.get_running_loop().time()
        self._deadline = Deadline(self.queue, None if timeout is None else loop_time + timeout, request_id)
        self.finished = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await self.queue.get()
                if isinstance(item, RequestTimeoutError):
                    raise item
                if item is None:
                    if self.flight.error is not None:
                        raise self.flight.error
                    return
                self.finished = item.finished
                yield item
        finally:
            self.close()

    def close(self) -> None:
        self._deadline.cancel()
        self.flight.leave(self)
