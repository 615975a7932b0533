"""AsyncEngine on a tiny model: streams, aborts, deadlines, back-pressure, dynamic batching,
the watchdog, and what a crashing engine does to requests in flight."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from llmaccel.config import EngineConfig
from llmaccel.engine.async_engine import AsyncEngine
from llmaccel.engine.engine import LLMEngine
from llmaccel.engine.engine_thread import BackgroundTask
from llmaccel.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError, RequestTimeoutError
from llmaccel.sampling_params import SamplingParams
from tests.tiny_models import hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def engine(llama_dir):
    return LLMEngine(EngineConfig.create(str(llama_dir), num_kv_blocks=64, max_num_seqs=8))


def run(coro_fn, engine: LLMEngine, **options):
    """Run `coro_fn(async_engine)` on a fresh event loop with a started AsyncEngine."""
    async def main():
        async_engine = AsyncEngine(lambda: engine, **options)
        await async_engine.start()
        try:
            return await coro_fn(async_engine)
        finally:
            await async_engine.shutdown()

    return asyncio.run(main())


async def wait_free(engine: LLMEngine) -> None:
    """While the engine still runs: every request gone and every block free."""
    deadline = time.monotonic() + 10
    while engine.has_unfinished_requests() or engine.num_free_blocks != engine.num_blocks:
        assert time.monotonic() < deadline, "blocks were not freed"
        await asyncio.sleep(0.01)


def test_streams_deliver_every_token_and_match_hf(engine, llama_dir):
    prompts = [engine.tokenize("The quick brown fox"), engine.tokenize("你好，世界")]

    async def go(ae: AsyncEngine):
        async def collect(ids):
            outputs = [out async for out in ae.add_request(ids, GREEDY)]
            return outputs

        results = await asyncio.gather(*(collect(ids) for ids in prompts))
        await wait_free(engine)
        return results

    results = run(go, engine)
    for ids, outputs in zip(prompts, results, strict=True):
        assert [len(o.outputs[0].token_ids) for o in outputs] == list(range(1, 13))  # one output per token
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
        assert outputs[-1].outputs[0].token_ids == hf_greedy(llama_dir, ids, 12)
        assert "".join(o.outputs[0].delta_text for o in outputs) == outputs[-1].outputs[0].text


def test_closing_a_stream_early_aborts_and_frees_blocks(engine):
    async def go(ae: AsyncEngine):
        stream = ae.add_request(engine.tokenize("Once upon a time"), SamplingParams(max_tokens=500, ignore_eos=True))
        async for out in stream:
            if len(out.outputs[0].token_ids) == 3:
                break
        stream.close()
        await wait_free(engine)

    run(go, engine)


def test_deadline_aborts_inside_the_engine(engine):
    async def go(ae: AsyncEngine):
        stream = ae.add_request(engine.tokenize("Once upon a time"), SamplingParams(max_tokens=900, ignore_eos=True),
                                timeout=0.05)
        with pytest.raises(RequestTimeoutError, match="deadline"):
            async for _ in stream:
                pass
        await wait_free(engine)

    run(go, engine)


def test_full_waiting_queue_refuses_without_queueing(engine):
    async def go(ae: AsyncEngine):
        params = SamplingParams(max_tokens=4, ignore_eos=True, n=2)
        first = ae.add_request([5, 6, 7], params)
        with pytest.raises(EngineOverloadedError, match="waiting queue is full"):
            ae.add_request([5, 6, 7], params)
        outputs = [out async for out in first]
        again = [out async for out in ae.add_request([5, 6, 7], params)]  # room again once the first ran
        return outputs[-1], again[-1]

    first, again = run(go, engine, max_waiting_requests=3)
    assert [len(c.token_ids) for c in first.outputs] == [4, 4] and again.finished


def test_invalid_prompt_raises_before_queueing(engine):
    async def go(ae: AsyncEngine):
        with pytest.raises(InvalidRequestError, match="max_model_len"):
            ae.add_request([5] * 2000, GREEDY)
        assert ae.num_waiting == 0

    run(go, engine)


def test_batch_delay_gathers_arrivals_into_one_first_step(engine):
    steps = []

    async def go(ae: AsyncEngine):
        streams = []
        for i in range(3):
            streams.append(ae.add_request(engine.tokenize(f"prompt {i}"), GREEDY))
            await asyncio.sleep(0.02)
        for stream in streams:
            async for _ in stream:
                pass

    run(go, engine, max_batch_delay_s=0.5, on_step=lambda step, took, preempted: steps.append(step.num_seqs))
    assert steps[0] == 3


def test_batch_delay_ends_early_when_max_num_seqs_are_waiting(llama_dir):
    engine = LLMEngine(EngineConfig.create(str(llama_dir), num_kv_blocks=64, max_num_seqs=2))
    steps = []

    async def go(ae: AsyncEngine):
        started = time.monotonic()
        streams = [ae.add_request(engine.tokenize(f"prompt {i}"), GREEDY) for i in range(2)]
        for stream in streams:
            async for _ in stream:
                pass
        return time.monotonic() - started

    took = run(go, engine, max_batch_delay_s=30.0, on_step=lambda step, took, preempted: steps.append(step.num_seqs))
    assert steps[0] == 2 and took < 15  # it did not sit out the 30 s delay


def test_watchdog_logs_slow_steps(engine):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("llmaccel").addHandler(handler)
    real_step = engine.step

    def slow_step(*args, **kwargs):
        time.sleep(0.3)
        return real_step(*args, **kwargs)

    engine.step = slow_step
    try:
        async def go(ae: AsyncEngine):
            async for _ in ae.add_request([5, 6, 7], SamplingParams(max_tokens=1)):
                pass

        run(go, engine, step_warn_s=0.1)
    finally:
        logging.getLogger("llmaccel").removeHandler(handler)
    assert any("engine step running for" in r.getMessage() for r in records)


def test_an_engine_whose_steps_keep_failing_stops_fails_requests_in_flight_and_refuses_new_ones(engine):
    calls, deaths = [], []

    def broken_step(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("kernel exploded")

    engine.step = broken_step

    async def go(ae: AsyncEngine):
        with pytest.raises(EngineDeadError, match="repeated internal errors") as info:
            async for _ in ae.add_request([5, 6, 7], GREEDY):
                pass
        assert "kernel exploded" not in str(info.value)  # internals stay in the log
        assert not ae.is_alive
        with pytest.raises(EngineDeadError):
            ae.add_request([5, 6, 7], GREEDY)

    run(go, engine, max_failed_steps=4, on_dead=deaths.append)
    assert len(calls) == 4 and [str(e) for e in deaths] == ["kernel exploded"]
    assert not engine.has_unfinished_requests() and engine.num_free_blocks == engine.num_blocks


def test_shutdown_aborts_what_is_left_and_frees_every_block(engine):
    async def go(ae: AsyncEngine):
        stream = ae.add_request([5, 6, 7], SamplingParams(max_tokens=900, ignore_eos=True))
        async for _ in stream:
            break
        return stream

    run(go, engine)
    assert not engine.has_unfinished_requests() and engine.num_free_blocks == engine.num_blocks


def test_background_task_runs_between_steps_and_a_failing_one_does_not_stop_serving(engine):
    """The quality watch's hook: it runs in the engine thread (never inside a step), repeatedly, and
    an exception in it is logged while requests keep being served."""
    import threading

    calls = []

    def task(e: LLMEngine) -> None:
        calls.append((threading.current_thread().name, e.last_step, e.has_unfinished_requests()))
        if len(calls) == 1:
            raise RuntimeError("first check fails")

    async def go(ae: AsyncEngine):
        deadline = time.monotonic() + 30
        while len(calls) < 3:
            assert time.monotonic() < deadline, "the background task stopped running"
            await asyncio.sleep(0.01)
        return [t async for t in ae.add_request([5, 6, 7], GREEDY)][-1]

    out = run(go, engine, background=BackgroundTask(0.01, task, "test task"))
    assert len(out.outputs[0].token_ids) == 12
    assert {name for name, _, _ in calls} == {"llmaccel-engine"}


def test_background_task_interval_must_be_positive(engine):
    with pytest.raises(ValueError, match="the quality check interval must be > 0 seconds"):
        AsyncEngine(lambda: engine, background=BackgroundTask(0, lambda e: None, "quality check"))
