"""The cascade benchmark: its threshold sweep on tiny models, with exact end points."""

from __future__ import annotations

import json

from llmaccel.bench.cascade import recommend, sweep
from llmaccel.cli import main


def test_sweep_routes_below_the_threshold_and_prices_both_models():
    small = [([1], [5, 6], -0.1), ([1], [7], -2.0), ([1], [8, 9, 9], -1.0)]  # (prompt, answer, confidence)
    large = [([1], [5, 6], -0.2), ([1], [4, 4], -0.3), ([1], [8, 8, 8, 8], -0.5)]
    points = sweep(small, large, [-1.0, -3.0, -2.0], [-0.5, -0.5, -0.5], small_spt=1.0, large_spt=4.0)
    assert [p["routed_to_large"] for p in points] == [0, 0, 1 / 3, 2 / 3, 1]
    large_only = 4.0 * (2 + 2 + 4)
    assert points[0]["cost"] == 6 / large_only  # small answers only: 6 tokens at 1 s
    assert points[-1]["cost"] == (6 + large_only) / large_only  # every request pays both
    assert [p["agreement"] for p in points] == [1 / 3, 1 / 3, 2 / 3, 1.0, 1.0]  # the first answer is identical
    assert points[2]["judged"] == (-1.0 - 0.5 - 2.0) / 3  # the least confident (-2.0) went to large
    chosen = recommend(points, keep=0.5)  # judgement -2.0 small-only, -0.5 large-only: goal -1.25
    assert chosen["threshold"] == -1.0 and chosen["judged"] == (-1.0 - 0.5 - 2.0) / 3  # -1.17: the cheapest there


def test_bench_cascade_writes_the_curve_and_the_plot(tiny_model_dirs, tmp_path, capsys):
    out, png = tmp_path / "cascade.json", tmp_path / "cascade.png"
    code = main(["bench", "cascade", "--model", str(tiny_model_dirs["llama-gqa"]), "--small",
                 str(tiny_model_dirs["llama-tied"]), "--num-prompts", "6", "--max-tokens", "8", "--timing-prompts", "1",
                 "--dtype", "float32", "--result-json", str(out), "--plot", str(png)])
    assert code == 0 and png.stat().st_size > 10_000
    result = json.loads(out.read_text())
    points = result["points"]
    assert points[0]["routed_to_large"] == 0 and points[-1]["routed_to_large"] == 1
    assert points[-1]["agreement"] == 1.0
    assert result["recommended"] in points
    assert "recommended: route to large below" in capsys.readouterr().out
