"""`llmaccel bench cascade-served`: the summary on hand-made requests, and whole runs through the CLI against real
servers of tiny models (a threshold no answer reaches sends every request to the large model, whose answers are
then large-only's; one every answer reaches keeps them all on the small model)."""

from __future__ import annotations

import json

import pytest

from llmaccel.bench.cascade_served import summarize
from llmaccel.cli import main
from tests.test_cascade_serving import _small_model


def _request(text: str, route: str, seconds: float) -> dict:
    return {"text": text, "route": route, "seconds": seconds}


def test_the_summary_counts_routes_latency_and_identical_answers():
    served = [_request("a", "small", 1.0), _request("b", "large", 4.0), _request("c", "large", 3.0)]
    large = [_request("x", "large", 2.0), _request("b", "large", 2.0), _request("c", "large", 2.0)]
    got = summarize(served, large)
    assert got["routed_to_large"] == pytest.approx(2 / 3)
    assert got["latency_vs_large_only"] == pytest.approx((8 / 3) / 2)
    assert got["latency_by_route"] == {"small": pytest.approx(0.5), "large": pytest.approx(1.75)}
    assert got["identical_to_large_only"] == pytest.approx(2 / 3)
    assert got["identical_when_routed_to_large"] == 1.0
    assert summarize(served[:1], large[:1])["identical_when_routed_to_large"] is None


@pytest.mark.slow
@pytest.mark.parametrize(("threshold", "routed"), [(1.0, 1.0), (-1e9, 0.0)])
def test_a_served_cascade_routes_as_its_threshold_says(tiny_model_dirs, tiny_tokenizer, tmp_path, threshold, routed):
    small = _small_model(tmp_path / "small", tiny_tokenizer)
    out = tmp_path / "served.json"
    code = main(["bench", "cascade-served", "--model", str(tiny_model_dirs["llama-tied"]), "--small", str(small),
                 "--threshold", str(threshold), "--decide-tokens", "4", "--num-prompts", "3", "--max-tokens", "6",
                 "--serve-args", "--dtype float32 --kv-cache-memory 16MiB", "--result-json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["routed_to_large"] == routed
    assert len(result["requests"]["cascade"]) == len(result["requests"]["large-only"]) == 3
    if routed == 1.0:  # the large model's greedy answers, served either way
        assert result["identical_to_large_only"] == 1.0
