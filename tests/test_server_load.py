"""e2e under load: 64 concurrent streams batch together; a vanished client is aborted and frees its
blocks; a burst over --max-waiting-requests gets 429s while accepted requests finish; /metrics
parses and its counters match what was sent."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai

from llmaccel.config import EngineConfig
from llmaccel.engine.engine import LLMEngine
from tests.live_server import MODEL_NAME, live_server, scrape


def _paced_engine(model_dir) -> LLMEngine:
    """An engine whose steps take at least 10 ms. The tiny model once wrote all 1,000 tokens before a
    busy test thread had read five chunks (a clean clone's run), leaving nothing to abort."""
    engine = LLMEngine(EngineConfig.create(str(model_dir), num_kv_blocks=256, max_num_seqs=64))
    step = engine.step

    def paced_step():
        time.sleep(0.01)
        return step()

    engine.step = paced_step
    return engine


def test_64_concurrent_streams_complete_and_share_steps(llama_dir):
    lengths = [8 + (i % 5) * 6 for i in range(64)]

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int, str]:
        stream = await client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": f"Tell me a story about a dragon number {i}."}],
            max_tokens=lengths[i], temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        text, usage, finish = [], None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for choice in chunk.choices:
                text.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        return usage, lengths[i], finish

    async def run_all(url: str) -> list[tuple[int, int, str]]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        return await asyncio.gather(*(one(client, i) for i in range(64)))

    with live_server(llama_dir, engine_options={"max_num_seqs": 64}) as server:
        results = asyncio.run(run_all(server.url))
        assert all(usage == expected and finish == "length" for usage, expected, finish in results)
        server.wait_idle()
        metrics = scrape(server.url)
    batch = metrics["llmaccel_step_batch_size_bucket"]
    steps = metrics["llmaccel_step_batch_size_count"][()]
    single = batch[(("le", "1.0"),)]
    assert single < steps and metrics["llmaccel_step_batch_size_sum"][()] / steps > 8  # really batched
    assert metrics["llmaccel_generation_tokens_total"][()] == sum(lengths)
    assert metrics["llmaccel_finished_sequences_total"][(("finish_reason", "length"),)] == 64
    assert metrics["llmaccel_http_requests_total"][(("endpoint", "/v1/chat/completions"), ("status", "200"))] == 64
    assert metrics["llmaccel_time_to_first_token_seconds_count"][()] == 64
    assert metrics["llmaccel_e2e_request_latency_seconds_count"][()] == 64
    assert metrics["llmaccel_inter_token_latency_seconds_count"][()] == sum(n - 1 for n in lengths)
    assert metrics["llmaccel_num_requests_running"][()] == 0 and metrics["llmaccel_kv_cache_usage_ratio"][()] == 0


def test_client_that_disconnects_mid_stream_is_aborted(llama_dir):
    with live_server(llama_dir, engine_factory=lambda: _paced_engine(llama_dir)) as server:
        body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 1000, "stream": True,
                "ignore_eos": True}
        with httpx.Client(timeout=30) as client, client.stream("POST", server.url + "/v1/completions",
                                                               json=body) as response:
            assert response.status_code == 200
            chunks = 0
            for line in response.iter_lines():
                chunks += line.startswith("data: {")
                if chunks == 5:
                    break
            assert server.engine.num_unfinished_requests == 1
        # the connection is closed here, mid-stream
        server.wait_idle(timeout=10)
        metrics = scrape(server.url)
        assert metrics["llmaccel_aborted_requests_total"][()] == 1
        assert metrics["llmaccel_generation_tokens_total"][()] < 1000
        # the server goes on serving
        ok = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_non_streaming_client_that_disconnects_is_aborted(llama_dir):
    with live_server(llama_dir) as server:
        body = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True}
        try:
            httpx.post(server.url + "/v1/completions", json=body, timeout=0.2)
        except httpx.ReadTimeout:
            pass
        server.wait_idle(timeout=10)
        assert scrape(server.url)["llmaccel_aborted_requests_total"][()] == 1


def test_burst_over_max_waiting_requests_gets_429_and_accepted_ones_finish(llama_dir):
    async def burst(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"prompt": "The quick brown fox", "max_tokens": 100, "ignore_eos": True, "temperature": 0}
            return await asyncio.gather(*(client.post(url + "/v1/completions", json=body) for _ in range(30)))

    with live_server(llama_dir, max_waiting_requests=4, engine_options={"max_num_seqs": 2}) as server:
        responses = asyncio.run(burst(server.url))
        accepted = [r for r in responses if r.status_code == 200]
        rejected = [r for r in responses if r.status_code == 429]
        assert len(accepted) + len(rejected) == 30 and rejected and len(accepted) >= 4
        assert all(r.json()["usage"]["completion_tokens"] == 100 for r in accepted)
        assert len({r.json()["choices"][0]["text"] for r in accepted}) == 1  # same greedy answer for all
        for r in rejected:
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full" and "waiting queue is full" in r.json()["error"]["message"]
        server.wait_idle()
        metrics = scrape(server.url)
        assert metrics["llmaccel_rejected_requests_total"][(("reason", "queue_full"),)] == len(rejected)
        assert metrics["llmaccel_http_requests_total"][(("endpoint", "/v1/completions"), ("status", "429"))] == \
            len(rejected)


def test_preemption_under_a_small_kv_pool_keeps_outputs_exact(llama_dir):
    """16 streams need ~64 blocks; the pool has 24, so the engine preempts and recomputes, and every
    greedy answer is still the one a lone request gets."""
    async def burst(url: str, prompts: list[str]) -> list[str]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)

        async def one(prompt: str) -> str:
            stream = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=40, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True})
            return "".join([chunk.choices[0].text async for chunk in stream])

        return await asyncio.gather(*(one(p) for p in prompts))

    prompts = [f"Request number {i}: tell me about paged attention and continuous batching." for i in range(16)]
    with live_server(llama_dir, engine_options={"num_kv_blocks": 24}) as server:
        alone = [httpx.post(server.url + "/v1/completions", json={"prompt": p, "max_tokens": 40, "temperature": 0,
                                                                   "ignore_eos": True}).json()["choices"][0]["text"]
                 for p in prompts[:3]]
        together = asyncio.run(burst(server.url, prompts))
        assert together[:3] == alone
        server.wait_idle()
        assert scrape(server.url)["llmaccel_preemptions_total"][()] > 0
