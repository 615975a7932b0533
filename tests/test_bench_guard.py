"""`llmaccel bench guard` on a tiny model: every answer checked, per variant."""

from __future__ import annotations

import json

from llmaccel.cli import main


def test_bench_guard_reports_each_variant(llama_dir, tmp_path, capsys):
    out = tmp_path / "guard.json"
    assert main(["bench", "guard", "--model", str(llama_dir), "--variants", "fp32,int8", "--num-prompts", "3",
                 "--max-tokens", "6", "--result-json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["fp32", "int8"]
    fp32, int8 = rows
    assert fp32["answers"] == 3 and fp32["anomalous"] == 0 and fp32["kl_max"] < 1e-6  # greedy float: KL 0
    assert 0 < int8["kl_p50"] < 0.35 and int8["anomalous"] == 0
    assert "| int8 | 3 | 0 | 0.0% |" in capsys.readouterr().out
