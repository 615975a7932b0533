"""`bench load-memory`: real `llmaccel serve` processes on a tiny model, their memory read at /health and
held against weights + KV pool + 15%."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmaccel.cli import main


def test_each_start_is_measured_against_the_bound_and_the_median_reported(llama_dir, tmp_path, capsys):
    out = tmp_path / "load.json"
    assert main(["bench", "load-memory", str(llama_dir), "--kv-cache-memory", "64MiB", "--repeats", "2", "--cold",
                 "--serve-args=--dtype bfloat16", "--result-json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "first starts (kernels timed)" in printed and "| peak GB at /health | bound GB (+15%) |" in printed
    result = json.loads(out.read_text())
    assert result["cold"] and result["kv_cache_memory"] == "64MiB" and result["serve_args"] == "--dtype bfloat16"
    [row] = result["rows"]
    assert len(row["starts"]) == 2 and row["model"] == str(llama_dir)
    for start in row["starts"]:
        assert start["kv_pool_bytes"] == 64 * 2**20  # the pool the flag asked for, read back from /metrics
        assert 0 < start["weights_bytes"] < start["kv_pool_bytes"]  # a tiny model's weights
        assert start["bound_bytes"] == int((start["weights_bytes"] + start["kv_pool_bytes"]) * 1.15)
        assert start["peak_bytes"] >= start["rss_bytes"] > 100e6  # a Python server with torch: well over 100 MB
        assert start["peak_over_bound"] == round(start["peak_bytes"] / start["bound_bytes"], 3)
        assert start["ready_s"] > 0
    assert row["peak_bytes"] == sorted(s["peak_bytes"] for s in row["starts"])[1]  # the median start of two

def test_a_model_that_cannot_be_served_is_named(tmp_path):
    with pytest.raises(RuntimeError, match="(?s)did not come up; its log:.*no-such-model.* not found"):
        main(["bench", "load-memory", str(tmp_path / "no-such-model")])


def test_the_page_cache_is_dropped_through_the_kernels_control_or_the_fix_is_named(tmp_path):
    from llmaccel.bench.load_memory import DROP_CACHES, drop_page_cache

    control = tmp_path / "drop_caches"
    control.write_text("0\n")
    drop_page_cache(control)
    assert control.read_text() == "1\n" and DROP_CACHES == Path("/proc/sys/vm/drop_caches")
    with pytest.raises(ValueError, match=r"--drop-page-cache cannot write .*missing/drop_caches .*run as root"):
        drop_page_cache(tmp_path / "missing" / "drop_caches")
