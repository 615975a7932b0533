"""Cascade serving (`serve --cascade-small`): the small model's answer when it is sure, the large model's
otherwise, decided on the small answer's first tokens; the route in a header and on /metrics; bad
cascades refused at start. Tiny random models, the official openai client, exact texts."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time

import httpx
import openai
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from llmaccel.config import EngineConfig, ServerConfig
from llmaccel.engine.engine import LLMEngine
from llmaccel.llm import LLM
from llmaccel.sampling_params import SamplingParams
from llmaccel.server.cascade import check_cascade
from tests.live_server import live_server, metric
from tests.tiny_models import _common, build_tokenizer

FLOAT32 = {"dtype": "float32"}
DECIDE = 4
QUESTION = "Tell me a story about a dragon."
MESSAGES = [{"role": "user", "content": QUESTION}]


def _small_model(root, tokenizer, max_positions: int = 1024):
    """One layer where the large tiny model has two: the same tokenizer, fewer weight bytes."""
    torch.manual_seed(99)
    config = LlamaConfig(**{**_common(tokenizer), "num_hidden_layers": 1, "max_position_embeddings": max_positions},
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    LlamaForCausalLM(config).eval().save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def models(tiny_model_dirs, tiny_tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("cascade")
    return {"large": tiny_model_dirs["llama-gqa"], "small": _small_model(root / "small", tiny_tokenizer),
            "short": _small_model(root / "short", tiny_tokenizer, max_positions=64)}


def offline(model_dir, max_tokens: int = 12):
    """The model's own greedy answer (text, token ids, logprobs) through the offline API."""
    out = LLM(str(model_dir), **FLOAT32).chat([MESSAGES], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                         logprobs=0), use_tqdm=False)[0].outputs[0]
    return out.text, list(out.token_ids), [lp.logprob for lp in out.logprobs]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def ask(server, stream: bool = False, **extra):
    """(answer text, route header, the raw response) of one greedy chat request of 12 tokens."""
    response = client(server).chat.completions.with_raw_response.create(
        model="tiny", messages=MESSAGES, max_tokens=12, temperature=0, stream=stream, **extra)
    route = response.headers.get("x-llmaccel-route")
    parsed = response.parse()
    if stream:
        return "".join(chunk.choices[0].delta.content or "" for chunk in parsed if chunk.choices), route, None
    return parsed.choices[0].message.content, route, parsed


def wait_both_idle(server) -> None:
    """Every request done and every KV block free again, in both engines (the routed small request aborted)."""
    deadline = time.monotonic() + 30
    for engine in (server.state.engine.engine, server.state.small_engine.engine):
        while engine.has_unfinished_requests() or engine.num_free_blocks != engine.num_blocks:
            assert time.monotonic() < deadline, "an engine kept requests or blocks"
            time.sleep(0.02)


def test_a_sure_small_model_answers_as_it_would_alone(models):
    small_text, small_ids, small_logprobs = offline(models["small"])
    with live_server(models["large"], small_dir=models["small"], cascade_threshold=float("-inf"),
                     cascade_decide_tokens=DECIDE, engine_options=FLOAT32) as server:
        text, route, response = ask(server)
        assert (text, route) == (small_text, "small")
        assert response.usage.completion_tokens == len(small_ids)
        assert response.choices[0].logprobs is None  # the cascade's own logprobs are not the client's
        assert ask(server, stream=True)[:2] == (small_text, "small")
        with client(server).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=900, temperature=0,
                                                    stream=True, extra_body={"ignore_eos": True}) as stream:
            next(iter(stream))  # the route is decided; the small request has ~900 steps (~1 s) to go
            assert metric(server, "llmaccel_cascade_small_num_requests_running") == 1
            assert metric(server, "llmaccel_cascade_small_kv_cache_usage_ratio") > 0
        _, _, response = ask(server, logprobs=True)
        assert [t.logprob for t in response.choices[0].logprobs.content] == pytest.approx(small_logprobs, abs=1e-5)
        assert metric(server, "llmaccel_cascade_requests_total", route="small") == 4
        assert metric(server, "llmaccel_cascade_requests_total", route="large") == 0
        wait_both_idle(server)


def test_an_unsure_small_model_hands_the_request_to_the_large_one(models):
    large_text, large_ids, _ = offline(models["large"])
    with live_server(models["large"], small_dir=models["small"], cascade_threshold=float("inf"),
                     cascade_decide_tokens=DECIDE, engine_options=FLOAT32) as server:
        text, route, response = ask(server)
        assert (text, route) == (large_text, "large")
        assert response.usage.completion_tokens == len(large_ids)
        assert ask(server, stream=True)[:2] == (large_text, "large")
        assert metric(server, "llmaccel_cascade_requests_total", route="large") == 2
        assert metric(server, "llmaccel_cascade_confidence_count") == 2
        wait_both_idle(server)
        assert metric(server, "llmaccel_cascade_small_num_requests_running") == 0
        assert metric(server, "llmaccel_cascade_small_kv_cache_usage_ratio") == 0.0


@pytest.mark.parametrize("side", ["just above", "just below"])
def test_the_route_turns_at_the_threshold_on_the_first_tokens(models, side):
    """The small answer's first DECIDE tokens' mean logprob, measured offline: a threshold a hair above it
    routes to the large model, a hair below keeps the small answer."""
    small_text, _, small_logprobs = offline(models["small"])
    large_text, _, _ = offline(models["large"])
    assert small_text != large_text  # so the answer tells the route
    confidence = statistics.fmean(small_logprobs[:DECIDE])
    assert confidence != statistics.fmean(small_logprobs)  # the rule reads the first tokens, not the whole answer
    threshold = confidence + (1e-4 if side == "just above" else -1e-4)
    with live_server(models["large"], small_dir=models["small"], cascade_threshold=threshold,
                     cascade_decide_tokens=DECIDE, engine_options=FLOAT32) as server:
        expected = (large_text, "large") if side == "just above" else (small_text, "small")
        assert ask(server)[:2] == expected
        assert ask(server, stream=True)[:2] == expected


def test_a_prompt_too_long_for_the_small_model_goes_to_the_large_one(models):
    long_question = " ".join(["dragon"] * 80)
    with live_server(models["large"], small_dir=models["short"], cascade_threshold=float("-inf"),
                     engine_options=FLOAT32) as server:
        response = httpx.post(server.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": long_question}], "max_tokens": 4, "temperature": 0})
        assert response.status_code == 200 and response.headers["x-llmaccel-route"] == "large"
        assert metric(server, "llmaccel_cascade_requests_total", route="large") == 1
        assert metric(server, "llmaccel_cascade_confidence_count") == 0  # decided without asking the small model
        wait_both_idle(server)


def test_cascades_that_cannot_work_are_refused_at_start(models, tmp_path):
    large = LLMEngine(EngineConfig.create(str(models["large"]), num_kv_blocks=16, **FLOAT32))
    with pytest.raises(ValueError, match="is not smaller than the model"):
        check_cascade(large, large, "the same model")
    other = _small_model(tmp_path / "other", build_tokenizer(vocab_size=300))
    stranger = LLMEngine(EngineConfig.create(str(other), num_kv_blocks=16, **FLOAT32))
    with pytest.raises(ValueError, match="cascade model .* must share the model's tokenizer"):
        check_cascade(stranger, large, str(other))
    with pytest.raises(ValueError, match="--cascade-small needs --cascade-threshold"):
        ServerConfig(cascade_small=str(models["small"]))
    with pytest.raises(ValueError, match="at least 1 token"):
        ServerConfig(cascade_small=str(models["small"]), cascade_threshold=-1.0, cascade_decide_tokens=0)
    with live_server(models["small"], small_dir=models["large"], cascade_threshold=-1.0, wait_ready=False,
                     engine_options=FLOAT32) as server:  # the "small" one is the larger: the server never serves
        deadline = time.monotonic() + 60
        while server.state.load_error is None:
            assert time.monotonic() < deadline, "the server did not refuse the cascade"
            time.sleep(0.05)
        assert "is not smaller than the model" in str(server.state.load_error)
        assert httpx.get(server.url + "/health").json() == {"status": "failed"}


def test_both_engines_run_in_one_thread(models):
    """A second thread running OpenMP regions slows every step of both engines (AsyncEngine's docstring):
    the small engine is built and stepped by the large one's thread."""
    with live_server(models["large"], small_dir=models["small"], cascade_threshold=0.0,
                     engine_options=FLOAT32) as server:
        def where(engine):
            return threading.get_ident()

        async def both():
            return await server.state.engine.call(where), await server.state.small_engine.call(where)

        large_thread, small_thread = asyncio.run_coroutine_threadsafe(both(), server.state.engine._loop).result(30)
        assert large_thread == small_thread != threading.get_ident()


def test_each_prompt_has_its_route_and_a_stored_result_says_cache(models):
    with live_server(models["large"], small_dir=models["small"], cascade_threshold=float("-inf"),
                     engine_options=FLOAT32, result_cache=True) as server:
        body = {"prompt": ["Tell me a story", "What is the capital of France?"], "max_tokens": 6, "temperature": 0}
        first = httpx.post(server.url + "/v1/completions", json=body)
        assert first.status_code == 200
        assert (first.headers["x-llmaccel-route"], first.headers["x-llmaccel-cache"]) == ("small,small", "miss")
        again = httpx.post(server.url + "/v1/completions", json=body)
        assert (again.headers["x-llmaccel-route"], again.headers["x-llmaccel-cache"]) == ("cache,cache", "hit")
        assert [c["text"] for c in again.json()["choices"]] == [c["text"] for c in first.json()["choices"]]
        assert metric(server, "llmaccel_cascade_requests_total", route="small") == 2  # the hits never ran


def test_a_deadline_passed_while_deciding_is_a_504_and_frees_every_block(models):
    """The small model has not reached its 400th token when the request's 0.02 s are up: a 504 with
    OpenAI's error JSON, streamed or not (a stream has sent nothing yet), and nothing left in either engine.
    (At 0.2 s a quiet Zen 5 decoded all 500 tokens first: 400 tokens of the tiny model take about 0.15 s.)"""
    with live_server(models["large"], small_dir=models["small"], cascade_threshold=float("-inf"),
                     cascade_decide_tokens=400, request_timeout=0.02, engine_options=FLOAT32) as server:
        for stream in (False, True):
            response = httpx.post(server.url + "/v1/chat/completions", json={
                "messages": MESSAGES, "max_tokens": 500, "ignore_eos": True, "stream": stream})
            assert response.status_code == 504, response.text
            assert response.json()["error"]["code"] == "request_timeout"
        wait_both_idle(server)
