"""Every bad input gets its status and OpenAI's error JSON, never a 500; timeouts, auth, startup."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from llmaccel.config import EngineConfig
from llmaccel.engine.engine import LLMEngine
from tests.live_server import MODEL_NAME, live_server, metric

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def server(llama_dir):
    with live_server(llama_dir) as live:
        yield live


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


BAD_BODIES = [  # (path, body, param the error must name, words the message must contain)
    (CHAT, {"messages": MESSAGES, "temperature": "hot"}, "temperature", "valid number"),
    (CHAT, {"messages": MESSAGES, "temperature": 3}, "temperature", "must be in [0, 2] (got 3)"),
    (CHAT, {"messages": MESSAGES, "top_p": 0}, "top_p", "must be in (0, 1] (got 0)"),
    (CHAT, {"messages": MESSAGES, "n": 0}, "n", "must be in [1, 128]"),
    (CHAT, {"messages": MESSAGES, "max_tokens": "5"}, "max_tokens", "valid integer"),
    (CHAT, {"messages": MESSAGES, "max_tokens": 0}, "max_tokens", "must be >= 1"),
    (CHAT, {"messages": MESSAGES, "presence_penalty": 5}, "presence_penalty", "must be in [-2, 2]"),
    (CHAT, {"messages": MESSAGES, "top_logprobs": 30, "logprobs": True}, "top_logprobs", "20"),
    (CHAT, {"messages": MESSAGES, "stream": "yes"}, "stream", "valid boolean"),
    (CHAT, {"messages": MESSAGES, "stop": ["ok", ""]}, "stop", "non-empty"),
    (CHAT, {"messages": MESSAGES, "seed": 1.5}, "seed", "valid integer"),
    (CHAT, {"messages": []}, "messages", "at least 1"),
    (CHAT, {"temperature": 0}, "messages", "required"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages", "role"),
    (CHAT, {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools", "tools"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, None,
     "image_url"),
    (CHAT, {"messages": MESSAGES, "stream_options": {"include_usage": True}}, None, "stream is true"),
    (CHAT, {"messages": MESSAGES, "logit_bias": {"5": 101}}, "logit_bias", "bias of token 5 must be in [-100, 100]"),
    (CHAT, {"messages": MESSAGES, "logit_bias": {"hello": 1}}, "logit_bias", "token ids written as strings"),
    (CHAT, {"messages": MESSAGES, "logit_bias": {"-3": 1}}, "logit_bias", "token ids written as strings"),
    (CHAT, {"messages": MESSAGES, "logit_bias": {"5": "x"}}, "logit_bias", "valid number"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"99999": 5}}, "logit_bias",
     "logit_bias: token id 99999 is outside the vocabulary"),
    (COMPLETIONS, {"prompt": 5}, "prompt", "list of token ids"),
    (COMPLETIONS, {"prompt": [1, "a"]}, "prompt", "list of token ids"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 21}, "logprobs", "20"),
    (COMPLETIONS, {"prompt": "hi", "suffix": "!"}, "suffix", "suffix"),
    (COMPLETIONS, {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs", "20"),
    (COMPLETIONS, {"prompt": "hi", "min_tokens": 10, "max_tokens": 5}, None, "min_tokens"),
    (COMPLETIONS, {"prompt": "hi", "top_k": -5}, "top_k", "must be >= -1"),
    (COMPLETIONS, {"prompt": [[1, 2], [99999]]}, "prompt", "prompt[1][0]: token id 99999 is outside the vocabulary"),
    (COMPLETIONS, {"prompt": ""}, None, "prompt is empty"),
]


@pytest.mark.parametrize("path,body,param,words", BAD_BODIES)
def test_bad_fields_get_400_naming_the_problem(server, path, body, param, words):
    error = error_of(httpx.post(server.url + path, json=body), 400)
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"]


def test_malformed_json_and_non_object_bodies(server):
    broken = httpx.post(server.url + CHAT, content=b'{"messages": [', headers={"content-type": "application/json"})
    assert "not valid JSON" in error_of(broken, 400)["message"]
    listed = httpx.post(server.url + CHAT, json=[1, 2])
    assert error_of(listed, 400)["message"]


def test_unknown_model(server):
    before = metric(server, "llmaccel_rejected_requests_total", reason="invalid_request")
    error = error_of(httpx.post(server.url + CHAT, json={"model": "gpt-9", "messages": MESSAGES}), 400)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "'gpt-9' does not exist" in error["message"] and MODEL_NAME in error["message"]
    assert metric(server, "llmaccel_rejected_requests_total", reason="invalid_request") == before + 1  # refused


def test_prompt_over_the_context_window_says_how_long(server):
    error = error_of(httpx.post(server.url + COMPLETIONS, json={"prompt": [5] * 1100}), 400)
    assert error["code"] == "context_length_exceeded"
    assert "1100 tokens" in error["message"] and "1024" in error["message"]
    error = error_of(httpx.post(server.url + COMPLETIONS, json={"prompt": [5] * 1000, "max_tokens": 100}), 400)
    assert "1100 were requested (1000 in the prompt, 100 for the completion)" in error["message"]
    assert "1024" in error["message"]


def test_unknown_routes_and_methods(server):
    assert error_of(httpx.post(server.url + "/v1/audio/speech", json={}), 404)["code"] == "not_found"
    assert error_of(httpx.get(server.url + CHAT), 405)["code"] == "method_not_allowed"


def test_unknown_fields_are_ignored(server):
    ok = httpx.post(server.url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 2, "frobnicate": 1})
    assert ok.status_code == 200
    server.wait_idle()


def test_request_timeout_gives_504_or_an_error_event_and_frees_blocks(llama_dir):
    # 0.1 s: on a quiet Zen 5 the tiny model decoded all 1,000 tokens inside 0.5 s (a 200, not the 504 asserted)
    with live_server(llama_dir, request_timeout=0.1) as server:
        body = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True}
        error = error_of(httpx.post(server.url + COMPLETIONS, json=body, timeout=30), 504)
        assert error["code"] == "request_timeout" and "deadline" in error["message"]
        with httpx.stream("POST", server.url + COMPLETIONS, json={**body, "stream": True}, timeout=30) as stream:
            lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and '"code":"request_timeout"' in lines[-2]
        assert len(lines) > 3  # some text came before the deadline
        server.wait_idle()
        metrics = httpx.get(server.url + "/metrics").text
        assert "llmaccel_timed_out_requests_total 2.0" in metrics


def test_api_key_is_required_on_v1_only(llama_dir):
    with live_server(llama_dir, api_keys=("sekrit",)) as server:
        assert error_of(httpx.get(server.url + "/v1/models"), 401)["code"] == "invalid_api_key"
        wrong = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer nope"})
        assert error_of(wrong, 401)["code"] == "invalid_api_key"
        good = openai.OpenAI(base_url=server.url + "/v1", api_key="sekrit", max_retries=0)
        assert good.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
        bad = openai.OpenAI(base_url=server.url + "/v1", api_key="guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        assert httpx.get(server.url + "/health").status_code == 200
        assert httpx.get(server.url + "/metrics").status_code == 200


def test_503_while_the_model_loads_then_ready(llama_dir):
    release = threading.Event()

    def slow_factory() -> LLMEngine:
        release.wait(30)
        return LLMEngine(EngineConfig.create(str(llama_dir), num_kv_blocks=64))

    with live_server(llama_dir, engine_factory=slow_factory, wait_ready=False) as server:
        deadline = time.monotonic() + 30
        while True:  # wait for uvicorn to listen
            try:
                health = httpx.get(server.url + "/health")
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert health.status_code == 503 and health.json() == {"status": "starting"}
        busy = httpx.post(server.url + CHAT, json={"messages": MESSAGES})
        assert error_of(busy, 503)["code"] == "not_ready" and busy.headers["retry-after"] == "5"
        release.set()
        while httpx.get(server.url + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert httpx.post(server.url + CHAT, json={"messages": MESSAGES, "max_tokens": 2}).status_code == 200


def test_failed_load_is_reported_by_health(llama_dir):
    def broken() -> LLMEngine:
        raise ValueError("no such checkpoint")

    with live_server(llama_dir, engine_factory=broken, wait_ready=False) as server:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(server.url + "/health").json() == {"status": "failed"}:
                    break
            except httpx.ConnectError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert error_of(httpx.post(server.url + CHAT, json={"messages": MESSAGES}), 503)["code"] == "not_ready"


def test_an_engine_whose_steps_keep_failing_turns_health_red_and_requests_get_503(llama_dir):
    def fragile() -> LLMEngine:
        engine = LLMEngine(EngineConfig.create(str(llama_dir), num_kv_blocks=64))
        real_step = engine.step

        def step(*args, **kwargs):
            if engine.num_steps >= 3:
                raise RuntimeError("kernel exploded")
            return real_step(*args, **kwargs)

        engine.step = step
        return engine

    with live_server(llama_dir, engine_factory=fragile) as server:
        with httpx.stream("POST", server.url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 50, "stream": True,
                                                                   "ignore_eos": True}) as stream:
            lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and "repeated internal errors" in lines[-2]
        assert '"code":"engine_unavailable"' in lines[-2] and "kernel exploded" not in lines[-2]
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and health.json() == {"status": "dead"}
        assert server.state.engine_died
        assert error_of(httpx.post(server.url + COMPLETIONS, json={"prompt": "hi"}), 503)["code"] == "not_ready"
