"""`GET /v1/llmaccel/stats`: the dashboard's JSON, read from the server's own Prometheus registry."""

from __future__ import annotations

import time

import httpx
import pytest

from llmaccel.server.metrics import parse_metrics
from llmaccel.server.stats import histogram_quantile
from tests.live_server import MODEL_NAME, live_server

INF = float("inf")


def test_histogram_quantile_interpolates_within_a_bucket_as_prometheus_does():
    buckets = [(0.1, 2.0), (0.2, 6.0), (0.4, 10.0), (INF, 10.0)]  # cumulative counts
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.175)  # rank 5: 3 of the 4 in (0.1, 0.2]
    assert histogram_quantile(0.1, buckets) == pytest.approx(0.05)  # rank 1: half of the first bucket
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.395)
    assert histogram_quantile(1.0, [(0.1, 0.0), (INF, 3.0)]) == 0.1  # past the last bound: its lower bound
    assert histogram_quantile(0.5, [(0.1, 0.0), (INF, 0.0)]) is None  # nothing observed
    assert histogram_quantile(0.5, []) is None


def test_stats_follow_the_metrics_and_move_with_load(llama_dir):
    with live_server(llama_dir) as server:
        url = server.url
        first = httpx.get(url + "/v1/llmaccel/stats").json()
        assert first["rates"]["output_tokens_per_s"] is None  # one snapshot: no rate yet, not a zero
        assert first["latency"]["ttft"]["p50_ms"] is None
        assert first["config"]["models"] == [MODEL_NAME] and first["config"]["kv_blocks"] == 256
        assert first["config"]["max_num_seqs"] == 64 and first["config"]["prefix_caching"] is True
        time.sleep(0.6)
        for i in range(4):
            reply = httpx.post(url + "/v1/completions", json={"prompt": f"The number {i} is", "max_tokens": 8,
                                                              "ignore_eos": True, "temperature": 0}, timeout=60)
            assert reply.status_code == 200
        bad = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": -1}, timeout=60)
        assert bad.status_code == 400
        stats = httpx.get(url + "/v1/llmaccel/stats").json()
        metrics = parse_metrics(httpx.get(url + "/metrics").text)
        generated = metrics["llmaccel_generation_tokens_total"][()]
        assert stats["totals"]["generation_tokens"] == generated == 32
        assert stats["totals"]["requests_finished"] == 4
        assert stats["totals"]["rejected"] == {"invalid_request": 1}
        window = stats["windows_s"]["rates"]  # rounded to the millisecond
        assert stats["rates"]["output_tokens_per_s"] == pytest.approx(32 / window, rel=2e-3)
        assert stats["rates"]["requests_per_s"] == pytest.approx(4 / window, rel=2e-3)
        assert stats["latency"]["ttft"]["count"] == 4 and stats["latency"]["ttft"]["p50_ms"] > 0
        assert stats["latency"]["e2e"]["p99_ms"] >= stats["latency"]["e2e"]["p50_ms"] > 0
        assert stats["engine"] == {"running": 0, "waiting": 0, "kv_cache_usage": 0}
        hits = metrics["llmaccel_prefix_cache_hits_total"][()]
        queries = metrics["llmaccel_prefix_cache_queries_total"][()]
        assert stats["prefix_cache"]["hit_tokens_total"] == hits
        assert stats["prefix_cache"]["queried_tokens_total"] == queries


def test_stats_need_the_api_key_like_the_api(llama_dir):
    with live_server(llama_dir, api_keys=("sesame",)) as server:
        refused = httpx.get(server.url + "/v1/llmaccel/stats")
        assert refused.status_code == 401 and "error" in refused.json()
        allowed = httpx.get(server.url + "/v1/llmaccel/stats", headers={"Authorization": "Bearer sesame"})
        assert allowed.status_code == 200 and allowed.json()["config"]["models"] == [MODEL_NAME]


def test_a_results_directory_that_is_not_one_is_an_error_at_start(tmp_path):
    from llmaccel.config import ServerConfig

    with pytest.raises(ValueError, match="--ui-results-dir .*missing.* is not a directory"):
        ServerConfig(ui_results_dir=str(tmp_path / "missing"))
