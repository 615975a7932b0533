"""A job: one accepted API request with its engine streams, and the merged outputs of those streams.

A completion request may carry several prompts; each is one stream (an engine request, a result-cache
replay or a subscription to an identical request in flight). `merged` yields their outputs as they
come, tagged with the prompt index, and always closes every stream (aborting what still runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

from llmaccel.engine.request_stream import RequestStream
from llmaccel.errors import ContentFilterError, RequestTimeoutError
from llmaccel.outputs import RequestOutput
from llmaccel.safety.output_guard import GuardReport
from llmaccel.sampling_params import SamplingParams
from llmaccel.server import protocol as p
from llmaccel.server.cascade import CascadeStream
from llmaccel.server.metrics import NullTracker, RequestTracker
from llmaccel.server.result_streams import FlightSubscriber, ReplayStream
from llmaccel.server.tools import ToolPlan

AnyRequest = p.ChatCompletionRequest | p.CompletionRequest
Stream = RequestStream | ReplayStream | FlightSubscriber | CascadeStream


class PrimedStream:
    """A stream whose first output has been read ahead (`prime`), then yielded first again: a streamed
    answer's status line waits for the semantic guard's verdict, which comes with the first output."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self._outputs = stream.__aiter__()
        self._first: RequestOutput | None = None

    async def prime(self) -> None:
        self._first = await anext(self._outputs)  # the stream's error (a blocked prompt's) raises here

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        async for output in self._outputs:
            yield output

    def close(self) -> None:
        self.stream.close()


async def prime_streams(job: Job) -> None:
    """Read each stream's first output ahead, so a blocked prompt is refused before the status line;
    if one raises, the job ends (every stream closed, its trackers told) and the error propagates."""
    primed = [PrimedStream(stream) for stream in job.streams]
    job.streams = primed
    try:
        for stream in primed:  # one after another: they run in the engine together all the same
            await stream.prime()
    except BaseException as exc:
        ended = ("content_filter" if isinstance(exc, ContentFilterError) else
                 "timeout" if isinstance(exc, RequestTimeoutError) else
                 "aborted" if isinstance(exc, asyncio.CancelledError) else "error")
        for tracker in job.trackers:
            tracker.finish(ended)
        for stream in primed:
            stream.close()
        if job.on_done is not None:
            job.on_done(0)
        raise


@dataclass
class Job:
    """One accepted API request: its engine streams and what the response needs."""

    request: AnyRequest
    response_id: str
    model: str
    streams: list[Stream]
    trackers: list[RequestTracker | NullTracker]
    prompt_ids: list[list[int]]
    params: list[SamplingParams]
    cache: str = "bypass"  # the result cache: "hit" (every prompt answered from it), "miss" or "bypass"
    created: int = field(default_factory=lambda: int(time.time()))  # the same in every chunk of a stream
    on_done: Callable[[int], None] | None = None  # called once with the completion tokens, however it ends
    guard_reports: list[GuardReport] = field(default_factory=list)  # the output guard's, per checked choice
    tools: ToolPlan | None = None  # a chat request's use of its tools (server/tools.py)

    @property
    def prompt_lengths(self) -> list[int]:
        return [len(ids) for ids in self.prompt_ids]

    @property
    def is_chat(self) -> bool:
        return isinstance(self.request, p.ChatCompletionRequest)


@contextlib.contextmanager
def outcome(trackers: list[RequestTracker]) -> Iterator[None]:
    """Record each tracker's metrics once, with how the request ended."""
    outcome = "aborted"  # cancelled or closed early: the client went away
    try:
        yield
        outcome = "ok"
    except RequestTimeoutError:
        outcome = "timeout"
        raise
    except ContentFilterError:
        outcome = "content_filter"  # the semantic guard ended it before its first token
        raise
    except Exception:
        outcome = "error"
        raise
    finally:
        for tracker in trackers:
            tracker.finish(outcome)


async def merged(job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of all of a job's streams as they come, tagged with the prompt index; at the end, however
    it comes, `job.on_done` learns how many tokens were generated."""
    last: dict[int, RequestOutput] = {}
    try:
        async with contextlib.aclosing(_merged_streams(job)) as outputs:  # closed now, not when collected
            async for i, output in outputs:
                last[i] = output
                yield i, output
    finally:
        if job.on_done is not None:
            job.on_done(sum(len(c.token_ids) for output in last.values() for c in output.outputs))


async def _merged_streams(job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
    if len(job.streams) == 1:
        try:
            async for output in job.streams[0]:
                job.trackers[0].on_output(output)
                yield 0, output
        finally:
            job.streams[0].close()
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: Stream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((i, output))
        except Exception as exc:
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(job.streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                job.trackers[i].on_output(item)
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in job.streams:
            stream.close()
