"""`llmaccel serve` as users start it (a real process), its SIGTERM drain, and `llmaccel chat`."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from llmaccel.bench import servers
from llmaccel.bench.servers import free_port
from llmaccel.cli import main
from llmaccel.llm import LLM
from llmaccel.sampling_params import SamplingParams
from tests.live_server import MODEL_NAME, live_server


def start_server(args: list[str], log: Path, timeout: float = 240) -> tuple[subprocess.Popen, str]:
    port = free_port()
    return servers.start_server([sys.executable, "-m", "llmaccel.cli", "serve", *args], port, log,
                                timeout), f"http://127.0.0.1:{port}"


def test_sigterm_drains_in_flight_requests(llama_dir, tmp_path):
    log = tmp_path / "serve.log"
    proc, url = start_server(["--model", str(llama_dir), "--num-kv-blocks", "256", "--graceful-shutdown-s", "60"], log)
    try:
        assert "serving" in log.read_text() and f"{url}/v1" in log.read_text()  # the startup line names the URL
        body = {"prompt": "Once upon a time", "max_tokens": 800, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        text, usage = [], None
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    text.append(chunk["choices"][0]["text"])
                    if len(text) == 1:
                        proc.send_signal(signal.SIGTERM)  # mid-stream
                        time.sleep(0.2)
                        with pytest.raises(httpx.ConnectError):  # no longer accepting
                            httpx.get(url + "/health", timeout=2)
                usage = chunk.get("usage") or usage
        assert usage["completion_tokens"] == 800  # the in-flight request finished in full
        assert proc.wait(60) == 0
        assert "shutting down" in log.read_text()
    finally:
        proc.kill()


def test_chat_cli_streams_from_a_server_and_keeps_the_conversation(llama_dir, monkeypatch, capsys):
    with live_server(llama_dir) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        first = [{"role": "user", "content": "Hello"}]
        reply1 = client.chat.completions.create(model=MODEL_NAME, messages=first, max_tokens=8,
                                                temperature=0).choices[0].message.content
        second = first + [{"role": "assistant", "content": reply1}, {"role": "user", "content": "And then?"}]
        reply2 = client.chat.completions.create(model=MODEL_NAME, messages=second, max_tokens=8,
                                                temperature=0).choices[0].message.content
        monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\nAnd then?\n/exit\n"))
        assert main(["chat", "--url", server.url, "--temperature", "0", "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("you> assistant> ") and f"assistant> {reply1}\n" in out and f"assistant> {reply2}\n" in out


def test_chat_cli_in_process_matches_the_offline_api(llama_dir, monkeypatch, capsys):
    llm = LLM(str(llama_dir))
    params = SamplingParams(temperature=0, max_tokens=8)
    reply1 = llm.chat([{"role": "user", "content": "Hello"}], params)[0].outputs[0].text
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\n/reset\nHello\n"))
    assert main(["chat", "--model", str(llama_dir), "--temperature", "0", "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert out.count(f"assistant> {reply1}\n") == 2  # /reset really started over


@pytest.mark.slow
def test_default_model_served_over_http(tmp_path):
    proc, url = start_server([], tmp_path / "serve.log")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        reply = client.chat.completions.create(model="smollm2-135m", messages=question, temperature=0, max_tokens=32)
        assert reply.choices[0].message.content == "The capital of France is Paris."
        assert reply.choices[0].finish_reason == "stop"
        streamed = client.chat.completions.create(model="smollm2-135m", messages=question, temperature=0,
                                                  max_tokens=32, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
            "The capital of France is Paris."
        curl = subprocess.run(["curl", "-s", url + "/v1/completions", "-H", "Content-Type: application/json",
                               "-d", '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}'],
                              capture_output=True, text=True, timeout=60)
        assert json.loads(curl.stdout)["usage"]["completion_tokens"] >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_result_cache_hits_survive_kill_9(llama_dir, tmp_path):
    """SQLite in WAL mode commits each result as it is stored: a server killed without warning loses none."""
    path, body = tmp_path / "results.db", {"prompt": "A paged KV cache", "max_tokens": 6, "temperature": 0}
    args = ["--model", str(llama_dir), "--num-kv-blocks", "64", "--result-cache-path", str(path)]
    proc, url = start_server(args, tmp_path / "first.log")
    try:
        first = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert first.headers["x-llmaccel-cache"] == "miss"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    proc, url = start_server(args, tmp_path / "second.log")
    try:
        again = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert again.headers["x-llmaccel-cache"] == "hit"
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
