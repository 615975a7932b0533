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
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from llmaccel.engine.engine import LLMEngine, StepStats
from llmaccel.engine.request_stream import RequestStream
from llmaccel.errors import ContentFilterError, EngineDeadError, EngineOverloadedError, RequestFailedError
from llmaccel.outputs import RequestOutput
from llmaccel.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

StepObserver = Callable[[StepStats, float, int], None]  # (what ran, seconds it took, preemptions so far)


@dataclass(frozen=True)
class BackgroundTask:
    """Low-priority work for the engine thread, every `interval_s` (see the module docstring).
    An exception is logged and the task tried again next interval; serving carries on."""

    interval_s: float
    run: Callable[[LLMEngine], None]
    name: str = "background task"


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    fn: Callable[[LLMEngine], object]
    future: asyncio.Future


class AsyncEngine:
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
        self._commands: deque[_Add | _Abort | _Call] = deque()
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
                    timeout: float | None = None, arrival_time: float | None = None) -> RequestStream:
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
            self._commands.append(_Add(request_id, list(prompt_token_ids), params,
                                       arrival_time if arrival_time is not None else time.time()))
            self._cond.notify()
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request inside the engine at its next step boundary; its KV blocks are freed then."""
        self._streams.pop(request_id, None)
        with self._cond:
            self._commands.append(_Abort(request_id))
            self._cond.notify()

    async def call(self, fn: Callable[[LLMEngine], object]) -> object:
        """Run `fn(engine)` in the engine thread between steps (scoring, say) and return its result or
        raise its exception. Calls run in the order they were made, after the adds queued before them."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        future = asyncio.get_running_loop().create_future()
        with self._cond:
            self._commands.append(_Call(fn, future))
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
            calls = [c for c in self._commands if isinstance(c, _Call)]
        for call in calls:
            if not call.future.done():
                call.future.set_exception(error)

    # ---- engine-thread side -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = engine = self._engine_factory()
        except BaseException as exc:
            self._error = exc
            self._loop.call_soon_threadsafe(self._set_ready, exc)
            return
        self._loop.call_soon_threadsafe(self._set_ready, None)
        loop_error: Exception | None = None  # the last failure, when it came from outside engine.step
        while True:
            try:
                outcome = self._iterate(engine)
            except Exception as exc:  # a fault outside any one request: logged, and the loop goes on
                outcome, loop_error = "failed", exc
                logger.exception("engine loop iteration failed (%d in a row)", self._failed_steps + 1)
            except BaseException as exc:  # the thread is being torn down: nobody may wait forever
                self._die(exc)
                raise
            else:
                if outcome == "failed":  # the forward pass failed; the engine logged it
                    loop_error = None
            if outcome == "stop":
                break
            if outcome != "idle":  # idle passes neither break nor extend a run of failed steps
                self._failed_steps = self._failed_steps + 1 if outcome == "failed" else 0
            if self._failed_steps >= self.max_failed_steps:
                self._die(loop_error or RuntimeError(f"the forward pass failed {self._failed_steps} steps in a row"))
                return
        self._apply_commands()  # shutting down: take the last aborts and calls, then free every block
        for guest in list(self._guests):
            guest.engine.abort_all()
        aborted = engine.abort_all()
        if aborted:
            logger.warning("shutdown aborted %d unfinished request(s)", aborted)

    def _iterate(self, engine: LLMEngine) -> str:
        """One pass of the loop: wait for work, take commands, run one step. Returns "ok" or "failed" (the
        step's forward pass raised), "idle" when no step ran, "stop" when stopping."""
        with self._cond:
            while not (self._has_work() or self._stopping or self._background_wait() == 0
                       or any(guest._has_work() for guest in self._guests)):
                self._cond.wait(self._background_wait())
            if self._stopping:
                return "stop"
            idle = not engine.has_unfinished_requests()
            guests = list(self._guests)
        for guest in guests:
            guest._take_turn()
        self._apply_commands()
        if idle and self.max_batch_delay_s > 0:
            self._gather_arrivals(time.monotonic() + self.max_batch_delay_s)
        self._run_background(idle=not engine.has_unfinished_requests())
        if not engine.has_unfinished_requests():
            return "idle"
        return self._step(engine)

    def _has_work(self) -> bool:
        if self._host is not None and (self._error is not None or self._stopping):
            return False  # a stopped guest: nothing of it runs again
        return bool(self._commands) or self.engine.has_unfinished_requests()

    def _take_turn(self) -> None:
        """A guest's turn in its host's loop: its commands, then one step if it has requests; after
        `max_failed_steps` failures in a row it stops alone (its streams fail, `on_dead` is called)."""
        if not self._has_work():
            return
        try:
            self._apply_commands()
            outcome = self._step(self.engine) if self.engine.has_unfinished_requests() else "idle"
        except Exception:
            outcome = "failed"
            logger.exception("the guest engine's loop pass failed (%d in a row)", self._failed_steps + 1)
        if outcome != "idle":
            self._failed_steps = self._failed_steps + 1 if outcome == "failed" else 0
        if self._failed_steps >= self.max_failed_steps:
            self._die(RuntimeError(f"the guest engine failed {self._failed_steps} steps in a row"))

    def _step(self, engine: LLMEngine) -> str:
        """One engine step, its outputs delivered: "ok", or "failed" when its forward pass raised."""
        self._step_started = time.monotonic()
        try:
            outputs = engine.step()
        finally:
            took = time.monotonic() - self._step_started
            self._step_started = None
        if outputs:
            self._loop.call_soon_threadsafe(self._deliver, outputs)
        if self.on_step is not None and engine.last_step.num_seqs:
            try:
                self.on_step(engine.last_step, took, engine.num_preemptions)
            except Exception:
                logger.exception("the step observer failed")
        return "failed" if engine.last_step_failed else "ok"

    def _die(self, error: BaseException) -> None:
        """Steps keep failing: stop the loop, fail everything in flight, free every block, tell on_dead."""
        self._error = error
        logger.error("the engine stopped after %d failed steps in a row; the last error: %r", self._failed_steps,
                     error)
        self._loop.call_soon_threadsafe(self._fail_all, EngineDeadError(
            "the engine stopped after repeated internal errors; retry once the server has restarted"))
        try:
            self.engine.abort_all()
        except Exception:
            logger.exception("freeing the requests of the stopped engine failed")
        if self.on_dead is not None:
            self.on_dead(error)
        for guest in list(self._guests):  # the host's thread ends: its guests stop with it
            if guest._error is None:
                guest._die(error)

    def _apply_commands(self) -> None:
        with self._cond:
            commands = list(self._commands)
            self._commands.clear()
        for command in commands:
            if isinstance(command, _Abort):
                self.engine.abort_request(command.request_id)
                continue
            if isinstance(command, _Call):
                self._run_call(command)
                continue
            try:
                self.engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                        command.arrival_time)
            except Exception as exc:  # validated already; deliver anything unexpected to its stream
                self._loop.call_soon_threadsafe(self._deliver_to, command.request_id, exc)
            finally:
                with self._cond:
                    self._pending_adds -= command.params.n

    def _run_call(self, call: _Call) -> None:
        try:
            result, error = call.fn(self.engine), None
        except Exception as exc:
            result, error = None, exc

        def settle() -> None:
            if call.future.done():  # the caller gave up meanwhile
                return
            if error is None:
                call.future.set_result(result)
            else:
                call.future.set_exception(error)

        self._loop.call_soon_threadsafe(settle)

    def _background_wait(self) -> float | None:
        """Seconds until the background task is due (0 if it is), None if there is none."""
        if self.background is None:
            return None
        return max(0.0, self._background_due - time.monotonic())

    def _run_background(self, idle: bool) -> None:
        task, now = self.background, time.monotonic()
        if task is None or now < self._background_due or (not idle and now < self._background_due + task.interval_s):
            return
        try:
            task.run(self.engine)
        except Exception:
            logger.exception("%s failed; retrying in %.0f s", task.name, task.interval_s)
        self._background_due = time.monotonic() + task.interval_s

    def _gather_arrivals(self, deadline: float) -> None:
        """Dynamic batching: wait for more arrivals until max_num_seqs wait or the deadline passes."""
        target = self.engine.config.scheduler.max_num_seqs
        while self.engine.num_waiting_seqs < target:
            with self._cond:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stopping:
                    return
                if not self._commands:
                    self._cond.wait(remaining)
            self._apply_commands()

    def _watch(self) -> None:
        interval = min(1.0, max(0.01, self.step_warn_s / 4))
        warned_for = None
        while self._thread.is_alive():
            time.sleep(interval)
            started = self._step_started
            if started is not None and started != warned_for and time.monotonic() - started > self.step_warn_s:
                warned_for = started
                last = self.engine.last_step
                logger.warning("engine step running for %.2f s (over --step-warn-s %.2f): %d sequences, %d tokens",
                               time.monotonic() - started, self.step_warn_s, last.num_seqs, last.num_tokens)
