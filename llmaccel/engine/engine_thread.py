"""The engine-thread half of AsyncEngine (engine/async_engine.py, which subclasses EngineThread and sets,
in its __init__, the state both halves share): the loop that applies the event loop's commands between
steps and steps the engine, a guest's turn in its host's loop, the background task (run when due and the
engine is idle, or one interval late at most if it never idles), dynamic batching, the step watchdog, and
stopping for good after `max_failed_steps` failed steps in a row.

The module docstring of async_engine.py says why all torch work runs in this one thread. What the thread
hands back goes through `loop.call_soon_threadsafe` to AsyncEngine's _set_ready, _deliver, _deliver_to
and _fail_all, which run on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from llmaccel.engine.engine import LLMEngine, StepStats
from llmaccel.errors import EngineDeadError
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
class AddCommand:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    owner: str = ""


@dataclass(frozen=True)
class AbortCommand:
    request_id: str


@dataclass(frozen=True)
class CallCommand:
    fn: Callable[[LLMEngine], object]
    future: asyncio.Future


class EngineThread:
    """What runs in the engine thread (see the module docstring)."""

    # set by AsyncEngine.__init__
    engine: LLMEngine | None
    background: BackgroundTask | None
    max_batch_delay_s: float
    step_warn_s: float
    on_step: StepObserver | None
    max_failed_steps: int
    on_dead: Callable[[BaseException], None] | None
    _engine_factory: Callable[[], LLMEngine]
    _background_due: float
    _failed_steps: int
    _host: EngineThread | None
    _guests: list[EngineThread]
    _commands: deque[AddCommand | AbortCommand | CallCommand]
    _pending_adds: int
    _cond: threading.Condition
    _stopping: bool
    _error: BaseException | None
    _step_started: float | None
    _loop: asyncio.AbstractEventLoop | None
    _thread: threading.Thread

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
        engine.close()

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
            self.engine.interrupt.clear()  # raised, if at all, for one of these: it is in the next step
        for command in commands:
            if isinstance(command, AbortCommand):
                self.engine.abort_request(command.request_id)
                continue
            if isinstance(command, CallCommand):
                self._run_call(command)
                continue
            try:
                self.engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                        command.arrival_time, command.priority, command.owner)
            except Exception as exc:  # validated already; deliver anything unexpected to its stream
                self._loop.call_soon_threadsafe(self._deliver_to, command.request_id, exc)
            finally:
                with self._cond:
                    self._pending_adds -= command.params.n

    def _run_call(self, call: CallCommand) -> None:
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
