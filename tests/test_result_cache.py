"""The result cache: the store's LRU, SQLite and TTL rules on their own, then hits, replay,
persistence and single-flight through a live server with the official openai client."""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest

from llmaccel.cache import result_cache as rc
from llmaccel.cache.result_cache import ResultCache, cache_key, is_cacheable
from llmaccel.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from llmaccel.sampling_params import SamplingParams
from tests.live_server import MODEL_NAME, live_server, metric


def _outputs(text: str) -> list[RequestOutput]:
    def output(part: str, finished: bool) -> RequestOutput:
        logprobs = [Logprob(5, -0.25, {5: -0.25, 9: -1.5})]
        completion = CompletionOutput(0, part, [5], "stop" if finished else None, logprobs, None, part)
        return RequestOutput("r", None, [1, 2], [completion], finished, RequestMetrics(1.0, 2.0, 3.0, 4.0))

    return [output(text[:2], False), output(text, True)]


def test_only_deterministic_single_samples_are_cacheable():
    assert is_cacheable(SamplingParams(temperature=0))
    assert is_cacheable(SamplingParams(temperature=0.8, seed=3))
    assert not is_cacheable(SamplingParams(temperature=0.8))
    assert not is_cacheable(SamplingParams(temperature=0, n=2))
    key = cache_key("model|float32", [1, 2], SamplingParams(temperature=0))
    assert key != cache_key("model|int8", [1, 2], SamplingParams(temperature=0))
    assert key != cache_key("model|float32", [1, 2], SamplingParams(temperature=0, max_tokens=17))
    biased = cache_key("model|float32", [1, 2], SamplingParams(temperature=0, logit_bias={5: 1.0}))
    assert key != biased == cache_key("model|float32", [1, 2], SamplingParams(temperature=0, logit_bias=[(5, 1)]))


def test_entries_round_trip_and_are_evicted_least_recently_used_by_count_and_bytes():
    cache = ResultCache(max_entries=2)
    cache.put("a", _outputs("alpha"))
    cache.put("b", _outputs("beta"))
    assert cache.get("a") == _outputs("alpha")  # a is now the most recently used
    cache.put("c", _outputs("gamma"))
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    assert (cache.stats.hits, cache.stats.misses, cache.stats.evictions) == (3, 1, 1)
    size = len(rc._encode(_outputs("alpha")))
    small = ResultCache(max_entries=100, max_bytes=2 * size + 1)
    for key in "xyz":
        small.put(key, _outputs("alpha"))
    assert len(small) == 2 and small.bytes == 2 * size and small.get("x") is None


def test_results_persist_in_sqlite_and_expire_after_the_ttl(tmp_path, monkeypatch):
    path = tmp_path / "results.db"
    now = [1000.0]
    monkeypatch.setattr(rc.time, "time", lambda: now[0])
    first = ResultCache(path=path, ttl_s=60)
    first.put("k", _outputs("kept"))
    first.close()
    second = ResultCache(path=path, ttl_s=60)  # a restart: memory is empty, the database is not
    assert second.get("k") == _outputs("kept")
    now[0] += 61
    assert second.get("k") is None
    second.close()
    assert ResultCache(path=path).get("k") is None  # the expired row was deleted


@pytest.fixture
def client_for():
    def make(server) -> openai.OpenAI:
        return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

    return make


def test_a_repeated_request_is_answered_from_the_cache(llama_dir, client_for):
    with live_server(llama_dir, result_cache=True) as server:
        client = client_for(server)
        args = dict(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=8, temperature=0)
        first = client.completions.with_raw_response.create(**args)
        second = client.completions.with_raw_response.create(**args)
        assert first.headers["x-llmaccel-cache"] == "miss" and second.headers["x-llmaccel-cache"] == "hit"
        a, b = first.parse(), second.parse()
        assert a.choices[0].text == b.choices[0].text and a.usage == b.usage
        assert b.usage.completion_tokens == 8
        assert metric(server, "llmaccel_engine_requests_total") == 1
        assert metric(server, "llmaccel_result_cache_hits_total") == 1
        assert metric(server, "llmaccel_result_cache_misses_total") == 1
        opted_out = client.completions.with_raw_response.create(**args, extra_body={"result_cache": False})
        assert opted_out.headers["x-llmaccel-cache"] == "bypass"
        sampled = dict(args, temperature=0.9)
        for _ in range(2):
            assert client.completions.with_raw_response.create(**sampled).headers["x-llmaccel-cache"] == "bypass"
        assert metric(server, "llmaccel_engine_requests_total") == 4
        server.wait_idle()


def test_a_streamed_hit_replays_the_original_chunks(llama_dir, client_for):
    with live_server(llama_dir, result_cache=True) as server:
        client = client_for(server)
        args = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "你好，世界"}], max_tokens=12,
                    temperature=0, stream=True, stream_options={"include_usage": True})
        runs = []
        for expected in ("miss", "hit"):
            raw = client.chat.completions.with_raw_response.create(**args)
            assert raw.headers["x-llmaccel-cache"] == expected
            chunks = list(raw.parse())
            runs.append(([c.choices[0].delta.content for c in chunks if c.choices], chunks[-1].usage))
        assert runs[0] == runs[1]
        assert "".join(d or "" for d in runs[1][0]) and runs[1][1].completion_tokens == 12
        plain = client.chat.completions.create(**{**args, "stream": False, "stream_options": None})
        assert plain.choices[0].message.content == "".join(d or "" for d in runs[0][0])
        assert metric(server, "llmaccel_engine_requests_total") == 1
        server.wait_idle()


def test_hits_survive_a_server_restart(llama_dir, client_for, tmp_path):
    path = str(tmp_path / "results.db")
    args = dict(model=MODEL_NAME, prompt="A paged KV cache", max_tokens=6, temperature=0)
    with live_server(llama_dir, result_cache=True, result_cache_path=path) as server:
        first = client_for(server).completions.create(**args)
        server.wait_idle()
    with live_server(llama_dir, result_cache=True, result_cache_path=path) as server:
        raw = client_for(server).completions.with_raw_response.create(**args)
        assert raw.headers["x-llmaccel-cache"] == "hit"
        assert raw.parse().choices[0].text == first.choices[0].text
        assert metric(server, "llmaccel_engine_requests_total") == 0


def test_identical_requests_in_flight_share_one_engine_request(llama_dir):
    async def both(url: str) -> list[httpx.Response]:
        body = {"model": MODEL_NAME, "prompt": "Continuous batching packs", "max_tokens": 40, "temperature": 0,
                "ignore_eos": True}
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(2)))

    with live_server(llama_dir, result_cache=True) as server:
        gate = threading.Event()
        real_step = server.engine.step

        def held_step(*args, **kwargs):  # the first step waits until both requests were accepted
            gate.wait(10)
            return real_step(*args, **kwargs)

        def open_gate_once_shared():
            shared = server.state.metrics.result_cache_shared
            for _ in range(3000):
                if shared._value.get() >= 1:
                    break
                threading.Event().wait(0.01)
            gate.set()

        server.engine.step = held_step
        threading.Thread(target=open_gate_once_shared, daemon=True).start()
        replies = asyncio.run(both(server.url))
        texts = [r.json()["choices"][0]["text"] for r in replies]
        assert texts[0] == texts[1] and replies[0].json()["usage"]["completion_tokens"] == 40
        assert metric(server, "llmaccel_engine_requests_total") == 1
        assert metric(server, "llmaccel_result_cache_shared_total") == 1
        server.wait_idle()
