"""Quality watch: `serve --quality-check-interval` exports the served model's validation perplexity
next to the full-precision reference, which `llmaccel quantize` stores or the first check measures."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from llmaccel.llm import LLM
from llmaccel.quantization.quality import QualityWatch, validation_perplexity
from tests.live_server import MODEL_NAME, live_server


def _gauges(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith("llmaccel_quality_")}


def test_server_exports_quantized_perplexity_beside_the_float_reference(llama_dir):
    quantized = validation_perplexity(LLM(str(llama_dir), quantization="int8", num_kv_blocks=64).engine)
    reference = validation_perplexity(LLM(str(llama_dir), num_kv_blocks=64).engine)
    assert quantized != reference
    with live_server(llama_dir, quality_check_interval_s=0.05, engine_options={"quantization": "int8"}) as server:
        deadline = time.monotonic() + 60
        while _gauges(server.url).get("llmaccel_quality_checks_total", 0) < 2:
            assert time.monotonic() < deadline, "no quality check ran"
            time.sleep(0.05)
        reply = httpx.post(server.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "The quick",
                                                                 "max_tokens": 5, "temperature": 0}).json()
        assert reply["usage"]["completion_tokens"] == 5
        gauges = _gauges(server.url)
        server.wait_idle()
    assert gauges["llmaccel_quality_perplexity"] == pytest.approx(quantized, rel=1e-9)
    assert gauges["llmaccel_quality_reference_perplexity"] == pytest.approx(reference, rel=1e-9)
    assert gauges["llmaccel_quality_perplexity_change_ratio"] == pytest.approx(quantized / reference - 1, rel=1e-6)


def test_a_saved_checkpoint_carries_its_reference(llama_dir, tmp_path):
    from llmaccel.cli import main

    out = tmp_path / "int4"
    assert main(["quantize", "--model", str(llama_dir), "--method", "int4", "--group-size", "32",
                 "--out", str(out)]) == 0
    stored = json.loads((out / "llmaccel_quantization.json").read_text())["reference_perplexity"]
    assert stored == pytest.approx(validation_perplexity(LLM(str(llama_dir), num_kv_blocks=64).engine), rel=1e-9)
    reports = []
    engine = LLM(str(out), num_kv_blocks=64).engine
    QualityWatch(lambda measured, ref: reports.append((measured, ref)))(engine)
    assert reports == [(pytest.approx(validation_perplexity(engine), rel=1e-9), stored)]


def test_a_float_model_is_its_own_reference(llama_dir):
    reports = []
    watch = QualityWatch(lambda measured, ref: reports.append((measured, ref)))
    engine = LLM(str(llama_dir), num_kv_blocks=64).engine
    watch(engine)
    watch(engine)
    assert reports[0][0] == reports[0][1] == reports[1][0] == reports[1][1]
