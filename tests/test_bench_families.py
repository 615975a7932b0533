"""`llmaccel bench families` end to end, at a tiny shape: each family's checkpoint is made once by
transformers, and HF and llmaccel both run it (the default model's tokenizer, so this is slow)."""

from __future__ import annotations

import json

import pytest

from llmaccel.bench import families
from llmaccel.cli import main

pytestmark = pytest.mark.slow


def test_bench_families_writes_each_familys_figures(tmp_path, monkeypatch):
    monkeypatch.setattr(families, "SHAPE", dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                                                intermediate=128, positions=512))
    monkeypatch.setattr(families, "default_cache_dir", lambda: tmp_path / "cache")
    out = tmp_path / "families.json"
    assert main(["bench", "families", "--families", "qwen3,gpt2", "--one-len", "8", "--batch", "2",
                 "--batch-len", "4", "--result-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["architecture"] for r in result["families"]] == ["Qwen3ForCausalLM", "GPT2LMHeadModel"]
    for row in result["families"]:
        for workload in ("one", "batch"):
            figures = row[workload]
            assert figures["hf_tok_s"] > 0 and figures["llmaccel_tok_s"] > 0
            assert figures["ratio"] == pytest.approx(figures["llmaccel_tok_s"] / figures["hf_tok_s"])
    assert result["machine"]["cores"] >= 1 and result["shape"]["layers"] == 2
    assert (tmp_path / "cache" / "bench-families" / "qwen3-2x64" / "llmaccel-complete").is_file()
    with pytest.raises(SystemExit, match="--families: unknown falcon"):
        main(["bench", "families", "--families", "falcon"])
