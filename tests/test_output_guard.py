"""The output guard and the output filter: the divergence against HF's own logits, anomaly detection
on a served variant with corrupted weights, resampling, streams, and the metrics; the output filter
redacting and stopping answers, whole and streamed alike."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
import torch

from llmaccel.config import EngineConfig
from llmaccel.engine.engine import LLMEngine
from llmaccel.llm import LLM
from llmaccel.safety.input_filter import InputFilter
from llmaccel.safety.normalize import normalize
from llmaccel.safety.output_filter import OutputTextFilter
from llmaccel.safety.rules import load_rules
from llmaccel.sampling_params import SamplingParams
from tests.live_server import MODEL_NAME, live_server, metric
from tests.tiny_models import _hf_model

PROMPT = [5, 17, 42, 99, 7, 23, 61, 8, 150, 33]


def _corrupted_int8_engine(model_dir):
    """An INT8 variant whose attention output weights are negated: it serves nonsense that the
    full-precision reference scores as very unlikely."""
    engine = LLMEngine(EngineConfig.create(str(model_dir), quantization="int8", num_kv_blocks=256))
    for layer in engine.runner.model.layers:  # -w: negative row scales where the kernel's blocks hold w
        (layer.o.row_scale if layer.o.streams else layer.o.q).neg_()
    return engine


def test_divergence_matches_a_hand_computation_on_hf_logits(llama_dir):
    llm = LLM(str(llama_dir))
    params = SamplingParams(temperature=0.5, top_k=5, max_tokens=12, seed=3, ignore_eos=True)
    output = llm.generate(PROMPT, params)[0].outputs[0].token_ids
    got = llm.engine.divergence(PROMPT, output, params)
    with torch.no_grad():
        logits = _hf_model(llama_dir)(torch.tensor([PROMPT + output])).logits[0, len(PROMPT) - 1:-1].double()
    raw = torch.log_softmax(logits, dim=-1)
    scaled = logits / 0.5
    kept = scaled >= scaled.topk(5, dim=-1).values[:, -1:]
    q = torch.softmax(scaled.masked_fill(~kept, float("-inf")), dim=-1)
    kl = torch.where(q > 0, q * (q.log() - raw), torch.zeros_like(q)).sum(dim=-1)
    assert got.num_tokens == 12
    assert got.mean_kl == pytest.approx(float(kl.mean()), rel=1e-4)
    assert got.mean_confidence == pytest.approx(float(q.max(dim=-1).values.mean()), rel=1e-4)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert llm.engine.divergence(PROMPT, llm.generate(PROMPT, greedy)[0].outputs[0].token_ids, greedy).mean_kl < 1e-6


def test_a_quantized_variant_is_compared_with_its_full_precision_model(llama_dir):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    healthy = LLM(str(llama_dir), quantization="int8")
    output = healthy.generate(PROMPT, params)[0].outputs[0].token_ids
    small = healthy.engine.divergence(PROMPT, output, params)
    assert 0 < small.mean_kl < 0.05  # int8 rounding, measured against the float copy
    assert _corrupted_int8_engine(llama_dir).divergence(PROMPT, output, params).mean_kl > 0.35


def test_a_corrupted_variant_is_resampled_then_served_flagged(llama_dir):
    with live_server(llama_dir, engine_factory=lambda: _corrupted_int8_engine(llama_dir),
                     guard_sample_rate=1.0, guard_retries=2) as server:
        response = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 16,
                                                                    "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200 and response.headers["x-llmaccel-guard"] == "flagged"
        [report] = response.json()["guard"]
        assert report["verdict"] == "flagged" and report["attempts"] == 3 and report["mean_kl"] > 0.35
        assert metric(server, "llmaccel_guard_checks_total") == 3
        assert metric(server, "llmaccel_guard_anomalies_total") == 1
        assert metric(server, "llmaccel_guard_resamples_total") == 2
        assert metric(server, "llmaccel_guard_flagged_total") == 1
        assert metric(server, "llmaccel_guard_abnormal_output_ratio") == 1.0
        assert metric(server, "llmaccel_engine_requests_total") == 3  # the answer and two retries
        server.wait_idle()


def test_a_distorting_temperature_is_resampled_hotter_and_passes(llama_dir):
    """On a float model the reference is its raw distribution: sampling at temperature 0.2 sharpens it
    far from that (anomalous); the retry at temperature 1 draws from it exactly (KL 0)."""
    with live_server(llama_dir, guard_sample_rate=1.0) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        raw = client.completions.with_raw_response.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16,
                                                          temperature=0.2, seed=5, extra_body={"ignore_eos": True})
        assert raw.headers["x-llmaccel-guard"] == "resampled"
        body = raw.http_response.json()
        assert body["guard"][0]["attempts"] == 2 and body["guard"][0]["mean_kl"] < 1e-6
        assert metric(server, "llmaccel_guard_resample_successes_total") == 1
        assert body["usage"]["completion_tokens"] == 16
        greedy = client.completions.with_raw_response.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8,
                                                             temperature=0)
        assert greedy.headers["x-llmaccel-guard"] == "pass"
        assert metric(server, "llmaccel_guard_abnormal_output_ratio") == 0.5


def test_a_stream_is_checked_before_its_final_chunk_and_never_resampled(llama_dir):
    with live_server(llama_dir, engine_factory=lambda: _corrupted_int8_engine(llama_dir),
                     guard_sample_rate=1.0) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}))
        final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(final) == 1 and final[0].model_extra["guard"][0]["verdict"] == "anomalous"
        assert metric(server, "llmaccel_guard_resamples_total") == 0


def test_the_confidence_trigger_checks_only_confident_answers(llama_dir):
    with live_server(llama_dir, guard_confidence=0.999) as server:  # the tiny model is never that sure
        response = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8})
        assert "x-llmaccel-guard" not in response.headers and metric(server, "llmaccel_guard_checks_total") == 0
    with live_server(llama_dir, guard_confidence=0.001) as server:
        response = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8})
        assert response.headers["x-llmaccel-guard"] == "pass"


def _rules_for(tmp_path, text: str):
    """A redact rule and a block rule on pieces of the model's own greedy answer."""
    normalized = normalize(text)
    redact, block = re.escape(normalized[4:9]), re.escape(normalized[30:36])
    path = tmp_path / "out.yaml"
    path.write_text(f"rules:\n  - id: out.redact\n    action: redact\n    patterns: ['{redact}']\n"
                    f"    replacement: '<R>'\n  - id: out.block\n    action: block\n    patterns: ['{block}']\n")
    return str(path)


def test_the_output_filter_redacts_and_stops_whole_and_streamed_answers_alike(llama_dir, tmp_path):
    params = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    with live_server(llama_dir) as plain:
        text = httpx.post(plain.url + "/v1/completions", json=params).json()["choices"][0]["text"]
    rules = _rules_for(tmp_path, text)
    expected_filter = OutputTextFilter(InputFilter(load_rules([rules])))
    expected = expected_filter.whole(text)
    assert expected_filter.stopped_by == "out.block" and "<R>" in expected and len(expected) < len(text)
    with live_server(llama_dir, output_rules=(rules,)) as server:
        whole = httpx.post(server.url + "/v1/completions", json=params).json()["choices"][0]
        assert whole["text"] == expected and whole["finish_reason"] == "content_filter"
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        chunks = list(client.completions.create(model=MODEL_NAME, stream=True, **{k: v for k, v in params.items()
                                                                                 if k != "ignore_eos"},
                                                extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
        assert chunks[-1].choices[0].finish_reason == "content_filter"
        server.wait_idle()  # the stopped generation was aborted, its blocks freed


@pytest.mark.parametrize("piece", [1, 3, 7, 100])
def test_streamed_redaction_equals_whole_redaction(piece):
    text_filter = InputFilter(load_rules(["default-output"]))
    text = "key AKIAABCDEFGHIJKLMNOP and card 4111 1111 1111 1111, end -----BEGIN PRIVATE KEY-----\nabc\n" \
           "-----END PRIVATE KEY----- bye"
    whole = OutputTextFilter(text_filter).whole(text)
    assert whole == "key [REDACTED] and card [REDACTED], end [REDACTED] bye"
    stream = OutputTextFilter(text_filter)
    streamed = "".join(stream.push(text[i:i + piece], False) for i in range(0, len(text), piece))
    assert streamed + stream.push("", True) == whole
    long_text = ("Some ordinary words go here. " * 40 + text) * 3  # far past the filter's look-back
    stream = OutputTextFilter(text_filter)
    streamed = "".join(stream.push(long_text[i:i + piece], False) for i in range(0, len(long_text), piece))
    assert streamed + stream.push("", True) == OutputTextFilter(text_filter).whole(long_text)
    assert OutputTextFilter(text_filter).whole(long_text).count("[REDACTED]") == 9


def test_an_answer_the_engine_cannot_score_now_is_served_unchecked():
    import asyncio

    from llmaccel.outputs import CompletionOutput
    from llmaccel.safety.output_guard import GuardConfig, OutputGuard
    from llmaccel.server.metrics import ServerMetrics

    async def full_pool(prompt, output, params):
        raise RuntimeError("not enough free KV blocks to score this text now")

    metrics = ServerMetrics()
    guard = OutputGuard(GuardConfig(sample_rate=1.0), full_pool, metrics)
    answer = CompletionOutput(index=0, text="hi", token_ids=[5, 6], finish_reason="length")
    assert asyncio.run(guard.review([1, 2], SamplingParams(max_tokens=2), answer, None)) is None
    assert b"llmaccel_guard_skipped_total 1.0" in metrics.render()
