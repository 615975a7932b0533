"""`llmaccel bench safety` on real labelled sets: latency rows per length, recall and false positives."""

from __future__ import annotations

import json

from llmaccel.bench.safety import fit_length, percentile
from llmaccel.cli import main


def test_percentiles_and_fitted_lengths():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == 4.0
    texts = fit_length(["ab", "cde"], 6, 3)
    assert texts == ["ab cde", "cde ab", "ab cde"] and all(len(t) == 6 for t in texts)


def test_bench_safety_reports_latency_and_rates(tmp_path, capsys):
    out = tmp_path / "safety.json"
    assert main(["bench", "safety", "--jailbreak-sets", "dan", "--benign-sets", "builtin,mtbench",
                 "--lengths", "100,4000", "--samples", "20", "--result-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["chars"] for r in result["latency"]] == [100, 4000]
    assert all(r["samples"] == 20 and 0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"] for r in result["latency"])
    dan = result["jailbreak"][0]
    assert dan["set"] == "dan" and dan["prompts"] == 14 and dan["blocked"] == 14  # every DAN template
    assert [(r["set"], r["prompts"], r["blocked"]) for r in result["benign"]] == [("builtin", 200, 0),
                                                                                 ("mtbench", 160, 0)]
    assert "all jailbreaks: 14/14 blocked = 100.0%" in capsys.readouterr().out
