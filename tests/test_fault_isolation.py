"""Fault isolation: an error that belongs to one request ends that request alone; a step that fails as a
whole ends that step's requests; either way their blocks are freed and the engine goes on."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import pytest

from llmaccel.bench.servers import free_port
from llmaccel.config import ServerConfig
from llmaccel.engine.engine import LLMEngine
from llmaccel.engine.request_group import Sample
from llmaccel.llm import LLM
from llmaccel.runner import ModelRunner
from llmaccel.sampler import Sampler
from llmaccel.sampling_params import SamplingParams
from llmaccel.server import launch
from tests.live_server import live_server

POISON = [7, 7, 7, 7, 7, 7, 7, 13]  # the prompt whose sampling the injected fault breaks
PROMPTS = ["The quick brown fox", "Tell me a story about a dragon.", "你好，世界", "def hello():"]
PARAMS = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
          SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True),
          SamplingParams(temperature=1.0, top_k=20, seed=12, max_tokens=20, ignore_eos=True, n=2),
          SamplingParams(temperature=0.7, seed=13, max_tokens=20, ignore_eos=True, logprobs=2)]


@pytest.fixture
def llm(llama_dir):
    # no prefix cache: a rerun must compute each prompt as the first run did, to compare them to the bit
    # (a cached prompt's last token alone runs as a decode row, whose kernel may sum in another order)
    return LLM(str(llama_dir), num_kv_blocks=128, enable_prefix_caching=False)


def poison_sampler(monkeypatch) -> list[int]:
    """Make the batched sampler raise whenever a row of the poisoned prompt is in its batch; returns the
    list of batch sizes it refused."""
    refused: list[int] = []
    real = Sampler.sample

    def sample(self, logits, rows, confidence=False):
        if any(row.prompt_token_ids == POISON for row in rows):
            refused.append(len(rows))
            raise RuntimeError("injected sampler fault")
        return real(self, logits, rows, confidence)

    monkeypatch.setattr(Sampler, "sample", sample)
    return refused


def token_ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in outputs]


def assert_no_block_leaked(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests() and engine.num_free_blocks == engine.num_blocks


def test_a_sampler_fault_in_one_request_leaves_the_others_token_identical(llm, monkeypatch):
    clean = llm.generate(PROMPTS, PARAMS)
    refused = poison_sampler(monkeypatch)
    mixed = llm.generate(PROMPTS[:2] + [POISON] + PROMPTS[2:],
                         PARAMS[:2] + [SamplingParams(temperature=0.5, seed=3, max_tokens=20)] + PARAMS[2:])
    assert refused and max(refused) == 6  # it did break whole batches (4 requests, one with n=2, and the poison)
    failed = mixed.pop(2)
    assert token_ids(mixed) == token_ids(clean)
    assert [o.outputs[0].logprobs for o in mixed[3:]] == [o.outputs[0].logprobs for o in clean[3:]]
    assert failed.finished and failed.error == "RuntimeError: injected sampler fault"
    assert [c.finish_reason for c in failed.outputs] == ["error"] and failed.outputs[0].token_ids == []
    assert all(o.error is None for o in mixed)
    assert_no_block_leaked(llm.engine)
    monkeypatch.undo()
    assert token_ids(llm.generate(PROMPTS, PARAMS)) == token_ids(clean)  # and it serves on


def test_a_fault_in_one_sample_ends_its_whole_request(llm, monkeypatch):
    real_row = llm.engine.runner.sampling_row

    def sampling_row(request, drafts=None):
        if request.request_id.endswith("#1"):
            raise OverflowError("injected row fault")
        return real_row(request, drafts)

    monkeypatch.setattr(llm.engine.runner, "sampling_row", sampling_row)
    one, two = llm.generate(PROMPTS[:2], [PARAMS[0], SamplingParams(n=2, seed=5, max_tokens=8)])
    assert one.error is None and len(one.outputs[0].token_ids) == 20
    assert two.error == "OverflowError: injected row fault"
    assert [c.finish_reason for c in two.outputs] == ["error", "error"]
    assert_no_block_leaked(llm.engine)


def test_a_detokenizer_fault_ends_only_its_request(llm, monkeypatch):
    real = Sample.detokenize

    def detokenize(self, index=-1):
        if self.request.prompt_token_ids == POISON and self.request.num_output_tokens == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(self, index)

    monkeypatch.setattr(Sample, "detokenize", detokenize)
    clean = llm.generate(PROMPTS[0], PARAMS[0])
    good, bad = llm.generate([PROMPTS[0], POISON], PARAMS[0])
    assert good.outputs[0].token_ids == clean[0].outputs[0].token_ids
    assert bad.outputs[0].finish_reason == "error" and len(bad.outputs[0].token_ids) == 3
    assert bad.error.startswith("UnicodeDecodeError")
    assert_no_block_leaked(llm.engine)


def test_a_failed_forward_pass_ends_that_steps_requests_and_the_engine_goes_on(llm, monkeypatch):
    engine = llm.engine
    clean = llm.generate(PROMPTS, PARAMS[0])
    real_execute = engine.runner.execute
    calls = []

    def execute(scheduled, confidence=False, drafts=None, features=False, interrupt=None):
        calls.append(len(scheduled.scheduled))
        if len(calls) == 3:
            raise RuntimeError("injected kernel fault")
        return real_execute(scheduled, confidence, drafts, features, interrupt)

    monkeypatch.setattr(engine.runner, "execute", execute)
    engine.add_request("first", PROMPTS[0], PARAMS[0])
    engine.add_request("second", PROMPTS[1], PARAMS[0])
    outputs = [engine.step() for _ in range(3)][-1]
    assert engine.last_step_failed and engine.num_failed_steps == 1
    assert sorted(o.request_id for o in outputs) == ["first", "second"]
    assert all(o.finished and o.error == "RuntimeError: injected kernel fault" for o in outputs)
    assert {o.outputs[0].finish_reason for o in outputs} == {"error"}
    assert_no_block_leaked(engine)
    assert token_ids(llm.generate(PROMPTS, PARAMS[0])) == token_ids(clean)
    assert not engine.last_step_failed


def test_a_request_the_engine_fails_is_a_500_naming_it_and_the_server_serves_on(llama_dir, monkeypatch, caplog):
    poison_sampler(monkeypatch)
    with live_server(llama_dir) as server:
        body = {"prompt": POISON, "max_tokens": 5}
        with caplog.at_level("ERROR", logger="llmaccel"):
            failed = httpx.post(server.url + "/v1/completions", json=body)
            with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as stream:
                events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        error = failed.json()["error"]
        assert failed.status_code == 500 and error["code"] == "internal_error" and error["type"] == "internal_error"
        request_id = error["message"].split("request ")[1].split(";")[0]
        assert request_id.startswith("cmpl-") and "injected" not in error["message"]
        assert any(request_id in r.getMessage() and "injected sampler fault" in (r.exc_text or "")
                   for r in caplog.records)  # the traceback is in the log, under the same id
        assert events[-1] == "data: [DONE]" and '"code":"internal_error"' in events[-2]
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}
        ok = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        server.wait_idle()


def test_serve_exits_with_status_1_when_steps_keep_failing(llama_dir, monkeypatch):
    """A forward pass that fails every time: each request gets a 500, and after --max-failed-steps failed
    steps in a row the process exits non-zero (for a supervisor to restart it), not 503 forever."""
    real_execute = ModelRunner.execute

    def execute(self, scheduled, confidence=False, drafts=None, features=False, interrupt=None):
        if any(item.request.prompt_token_ids == POISON for item in scheduled.scheduled):
            raise RuntimeError("injected: the device is gone")
        return real_execute(self, scheduled, confidence, drafts, features, interrupt)

    monkeypatch.setattr(ModelRunner, "execute", execute)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    answers: list[int] = []

    def client() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.05)
        answers.append(httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}).status_code)
        for _ in range(2):  # failed steps count in a row across idle time, not per loop pass
            answers.append(httpx.post(url + "/v1/completions", json={"prompt": POISON, "max_tokens": 2}).status_code)
            time.sleep(0.2)

    thread = threading.Thread(target=client)
    thread.start()
    code = launch.serve(str(llama_dir), {"num_kv_blocks": 64}, ServerConfig(port=port, max_failed_steps=2))
    thread.join(30)
    assert answers == [200, 500, 500] and code == 1
