"""AsyncEngine: the engine loop in its own thread, an asyncio stream of outputs per request.

The engine thread does all of the torch work, from building the model to every step: once a second
thread has run an OpenMP region, libgomp manages more threads than there are cores and every barrier
stops spinning (its "throttled" wait), and the decode step, ~150 barriers a token, runs 35-80% slower
(measured on the 2-core EPYC). So the engine is built where it runs, and a second engine in the same
process (a cascade's small model) is a guest: `AsyncEngine(factory, host=first)` is built and stepped
by the host's thread, one step of each in turn, with streams and commands of its own.
The event loop never waits on the model. `add_request` validates and queues at once (raising
InvalidRequestError, EngineOverloadedError or EngineDeadError before anything is queued) and returns
a RequestStream. The engine thread takes queued adds and aborts between steps, so a new request
joins the running batch at the next step and an abort frees its KV blocks before the next step
runs. After each step the thread hands every changed output to the event loop in one call.
`call(fn)` runs a function on the engine in its thread between steps (the output guard's scoring).

A stream that is closed before its request finished (the client went away) or that passes its
deadline aborts the request. With `max_batch_delay_s`, an idle engine waits for more arrivals
before its first step (until `max_num_seqs` are waiting or the delay passes), as a dynamic batcher
does. A watchdog thread logs any step that runs longer than `step_warn_s`. A BackgroundTask (the
quality watch) runs in the engine thread between steps, at low priority: when due and the engine is
idle, or one interval late at most if it never idles.

Faults: the engine ends a request it fails on (finish reason "error") and its stream raises
RequestFailedError; the loop goes on. A pass of the loop that raises, or a step whose forward pass
failed, is logged and the loop goes on too; only after `max_failed_steps` such failures in a row does
the loop stop for good: every stream in flight gets EngineDeadError, every block is freed, and
`on_dead` is called so the server can exit for a supervisor to restart it.

The methods that run in the engine thread are engine/engine_thread.py's EngineThread, which AsyncEngine extends.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable

from llmaccel.engine.engine import LLMEngine
from llmaccel.engine.engine_thread import (
    AbortCommand,
    AddCommand,
    BackgroundTask,
    CallCommand,
    EngineThread,
    StepObserver,
)
from llmaccel.engine.request_stream import RequestStream
from llmaccel.errors import ContentFilterError, EngineDeadError, EngineOverloadedError, RequestFailedError
from llmaccel.outputs import RequestOutput
from llmaccel.sampling_params import SamplingParams


class AsyncEngine(EngineThread):
    def __init__(self, engine_factory: Callable[[], LLMEngine], max_batch_delay_s: float = 0.0,
                 step_warn_s: float = 10.0, max_waiting_requests: int | None = None,
                 on_step: StepObserver | None = None, background: BackgroundTask | None = None,
                 max_failed_steps: int = 3, on_dead: Callable[[BaseException], None] | None = None,
                 host: AsyncEngine | None = None) -> None:
        if max_batch_delay_s < 0 or step_warn_s <= 0:
            raise ValueError("max_batch_delay_s must be >= 0 and step_warn_s > 0")
        if max_failed_steps < 1:
            raise ValueError(f"max_failed_steps must be >= 1, got {max_failed_steps}")
        if background is not None and background.interval_s <= 0:
            raise ValueError(f"the {background.name} interval must be > 0 seconds, got {background.interval_s}")
        self.background = background
        self._background_due = 0.0  # monotonic time; 0: at the first chance
        self._engine_factory = engine_factory
        self.engine: LLMEngine | None = None  # built by start(), in the engine thread
        self.max_batch_delay_s = max_batch_delay_s
        self.step_warn_s = step_warn_s
        self.max_waiting_requests = max_waiting_requests
        self.on_step = on_step
        self.max_failed_steps = max_failed_steps
        self.on_dead = on_dead  # called (in the engine thread) when the loop stops for good after errors
        self._failed_steps = 0  # in a row
        self._host = host  # a guest runs in its host's thread (see the module docstring)
        self._guests: list[AsyncEngine] = []
        self._streams: dict[str, RequestStream] = {}
        self._commands: deque[AddCommand | AbortCommand | CallCommand] = deque()
        self._pending_adds = 0  # sequences queued for the engine thread, not yet in its scheduler
        self._cond = host._cond if host is not None else threading.Condition()  # a guest's news wakes the host
        self._stopping = False
        self._error: BaseException | None = None
        self._step_started: float | None = None
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = host._thread if host is not None else threading.Thread(target=self._run, name="llmaccel-engine",
                                                                             daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="llmaccel-watchdog", daemon=True)

    # ---- event-loop side ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Build the engine in the engine thread and start its loop. Returns when the engine is ready;
        raises whatever building it raised. Call from the event loop that will consume the streams."""
        self._loop = asyncio.get_running_loop()
        if self._host is not None:
            self.engine = await self._host.call(lambda _: self._engine_factory())
            with self._cond:
                self._host._guests.append(self)
            return
        self._ready: asyncio.Future[None] = self._loop.create_future()
        self._thread.start()
        await self._ready
        self._watchdog.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None and not self._stopping

    @property
    def num_waiting(self) -> int:
        """Sequences not yet running: queued for the engine thread or in the scheduler's queue."""
        return self._pending_adds + self.engine.num_waiting_seqs

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    timeout: float | None = None, arrival_time: float | None = None, priority: int = 0,
                    owner: str = "") -> RequestStream:
        """Queue a request and return its stream. Raises before queueing anything if the prompt is
        invalid (InvalidRequestError), the waiting queue is full (EngineOverloadedError) or the
        engine is not running (EngineDeadError)."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running" if self._error is None
                                  else "the engine stopped after repeated internal errors")
        self.engine.check_request(prompt_token_ids, params)
        if request_id is None:
            request_id = f"areq-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, request_id, None if timeout is None else loop.time() + timeout)
        with self._cond:
            if self.max_waiting_requests is not None and self.num_waiting + params.n > self.max_waiting_requests:
                raise EngineOverloadedError(f"the waiting queue is full ({self.num_waiting} sequences waiting, "
                                            f"limit {self.max_waiting_requests}); retry shortly")
            self._pending_adds += params.n
            self._streams[request_id] = stream
            self._commands.append(AddCommand(request_id, list(prompt_token_ids), params,
                                       arrival_time if arrival_time is not None else time.time(), priority, owner))
            if self.engine.scheduler.outranks_step(priority, owner):  # it should not wait for the step in flight
                self.engine.interrupt.raise_()
            self._cond.notify()
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request inside the engine at its next step boundary; its KV blocks are freed then."""
        self._streams.pop(request_id, None)
        with self._cond:
            self._commands.append(AbortCommand(request_id))
            self._cond.notify()

    async def call(self, fn: Callable[[LLMEngine], object]) -> object:
        """Run `fn(engine)` in the engine thread between steps (scoring, say) and return its result or
        raise its exception. Calls run in the order they were made, after the adds queued before them."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        future = asyncio.get_running_loop().create_future()
        with self._cond:
            self._commands.append(CallCommand(fn, future))
            self._cond.notify()
        return await future

    async def shutdown(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._host is None:
            await asyncio.to_thread(self._thread.join, timeout)
        elif self._host.is_alive and self.engine is not None:  # the host frees this guest's blocks
            with contextlib.suppress(EngineDeadError):
                await self._host.call(lambda _: self.engine.abort_all())
        self._fail_all(EngineDeadError("the server is shutting down"))

    def _set_ready(self, error: BaseException | None) -> None:
        if self._ready.done():  # start() was cancelled meanwhile
            return
        if error is None:
            self._ready.set_result(None)
        else:
            self._ready.set_exception(error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            if output.error is not None:  # the engine failed this request alone: its stream raises
                self._deliver_to(output.request_id, RequestFailedError(output.request_id))
            elif output.blocked is not None:  # the semantic guard ended it before its first token
                self._deliver_to(output.request_id, ContentFilterError(f"the prompt was blocked: {output.blocked}",
                                                                       "semantic-guard"))
            else:
                self._deliver_to(output.request_id, output)

    def _deliver_to(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:  # None: the request was aborted meanwhile
            stream._put(item)

    def _fail_all(self, error: BaseException) -> None:
        for stream in list(self._streams.values()):
            stream._put(error)
        with self._cond:
            calls = [c for c in self._commands if isinstance(c, CallCommand)]
        for call in calls:
            if not call.future.done():
                call.future.set_exception(error)
