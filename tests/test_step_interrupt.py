"""Stopping the step in flight between layers (model/step_interrupt.py): the C++ decode stack and the layer path
stop at the next layer boundary, the engine keeps nothing of the stopped step, and every request still ends with
the tokens of a run never stopped, its blocks returned."""

from __future__ import annotations

import pytest
import torch

from llmaccel import LLM
from llmaccel.model.step_interrupt import StepInterrupt, StepInterrupted
from llmaccel.ops.cpu_kernels import load_cpu_kernels
from llmaccel.ops.kernel_choice import FORCE_ENV, candidates
from llmaccel.sampling_params import SamplingParams

PROMPTS = [[5, 9, 13, 2, 7], list(range(20, 57)), [3] * 11]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
needs_stack = pytest.mark.skipif(not hasattr(load_cpu_kernels(), "DecodeStack"), reason="C++ kernels unavailable")


def _generate(llm: LLM, stop_at: set[int]) -> tuple[dict[str, list[int]], list[str]]:
    """Run PROMPTS to the end, raising the interrupt before each step numbered in `stop_at`. Returns each
    request's tokens and, for every stopped step, the path it stopped in."""
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, PARAMS)
    tokens: dict[str, list[int]] = {}
    stopped = []
    step = 0
    while engine.has_unfinished_requests():
        interrupted = engine.num_interrupted_steps
        if step in stop_at:
            engine.interrupt.raise_()
            before = {r.request_id: (r.num_computed_tokens, r.num_output_tokens) for r in engine.scheduler.running}
        outputs = engine.step(emit_unfinished=False)
        engine.interrupt.clear()
        if step in stop_at:
            assert outputs == [] and engine.num_interrupted_steps == interrupted + 1
            after = {r.request_id: (r.num_computed_tokens, r.num_output_tokens) for r in engine.scheduler.running
                     if r.request_id in before}
            assert after == {rid: before[rid] for rid in after}  # nobody advanced
            stopped.append("prefill" if step == 0 else "decode")
        for out in outputs:
            tokens[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert engine.num_free_blocks == engine.num_blocks
    return tokens, stopped


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_stopped_step_changes_no_request_and_the_tokens_are_those_of_an_unstopped_run(llama_dir, dtype):
    reference, _ = _generate(LLM(str(llama_dir), dtype=dtype, enable_prefix_caching=False), set())
    llm = LLM(str(llama_dir), dtype=dtype, enable_prefix_caching=False)
    tokens, stopped = _generate(llm, {0, 1, 4, 5, 9})  # the prompts' step, then decode steps (the stack's)
    assert tokens == reference and stopped == ["prefill", "decode", "decode", "decode", "decode"]


@needs_stack
@pytest.mark.parametrize(("dtype", "kernel"), [("float32", None), ("bfloat16", "stream"), ("bfloat16", "onednn")])
def test_the_decode_stack_stops_after_a_layer_when_the_flag_is_up(llama_dir, dtype, kernel, monkeypatch):
    if kernel is not None:
        if kernel not in candidates():
            pytest.skip(f"no {kernel} kernel on this CPU")
        monkeypatch.setenv(FORCE_ENV, kernel)
    llm = LLM(str(llama_dir), dtype=dtype, enable_prefix_caching=False)
    model = llm.engine.runner.model
    stack = model.decode_stack
    assert stack is not None
    calls = []
    real = stack.stack

    class Recording:  # the real stack, its answers recorded
        def forward(self, *args):
            calls.append(real.forward(*args))
            return calls[-1]

    stack.stack = Recording()
    tokens, stopped = _generate(llm, {2})
    assert stopped == ["decode"]
    assert [c.shape[0] for c in calls[:2]] == [3, 0]  # the second decode step stopped: no rows came back
    stack.stack = real
    assert tokens == _generate(LLM(str(llama_dir), dtype=dtype, enable_prefix_caching=False), set())[0]


def test_the_interrupt_is_one_int32_another_thread_raises_without_torch():
    interrupt = StepInterrupt()
    assert interrupt.flag.dtype == torch.int32 and interrupt.flag.shape == (1,) and not interrupt.is_raised
    interrupt.check()
    interrupt.raise_()
    assert interrupt.flag.item() == 1 and interrupt.is_raised
    with pytest.raises(StepInterrupted):
        interrupt.check()
    interrupt.clear()
    assert interrupt.flag.item() == 0


def test_a_high_priority_arrival_over_http_stops_the_low_priority_step_in_flight(llama_dir):
    """Every step here spends 30 ms in its first layer (a hook sleeps there, the GIL let go, as a real layer
    does): a high-priority request sent meanwhile stops that step at the next layer boundary, goes first, and
    every low-priority request still gets all its tokens; /metrics counts the stopped steps."""
    import asyncio
    import time

    import openai

    from tests.live_server import MODEL_NAME, live_server, metric, wait_until

    with live_server(llama_dir, engine_options={"policy": "priority"}) as server:
        engine = server.engine
        engine.runner.model.decode_stack = None  # every step through the layers, past the hook
        engine.runner.model.layers[0].register_forward_pre_hook(lambda *_: time.sleep(0.03))
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)

        async def ask(priority: int, tokens: int) -> list[int]:
            out = await client.completions.create(model=MODEL_NAME, prompt="count on", max_tokens=tokens,
                                                  temperature=0, extra_body={"priority": priority, "ignore_eos": True})
            return out.usage.completion_tokens

        async def run() -> tuple[list[int], list[int]]:
            lows = [asyncio.create_task(ask(5, 40)) for _ in range(3)]
            await asyncio.to_thread(wait_until, lambda: engine.num_running_seqs == 3, 30, "three running requests")
            highs = []
            for _ in range(10):  # one that lands inside a step (not between two) is enough; most do
                highs.append(await ask(0, 2))
                if engine.num_interrupted_steps:
                    break
            return highs, await asyncio.gather(*lows)

        highs, lows = asyncio.run(run())
        assert engine.num_interrupted_steps >= 1 and set(highs) == {2} and lows == [40, 40, 40]
        assert metric(server, "llmaccel_interrupted_steps_total") == engine.num_interrupted_steps
        server.wait_idle()
