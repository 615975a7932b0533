"""`bench compare` (real server processes on a tiny model), `bench sweep` against a live server, and
`bench plot`: the PNGs are opened and must be real, non-trivial images."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time

import matplotlib.image
import numpy as np
import pytest

from llmaccel.bench.ceiling import ceiling_share
from llmaccel.bench.compare import paired_leads
from llmaccel.bench.servers import _process_tree, peak_rss_bytes
from llmaccel.bench.sweep import plot_results
from llmaccel.cli import main
from tests.live_server import live_server


def assert_real_png(path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[0] >= 300 and pixels.shape[1] >= 500
    assert np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0).shape[0] > 20  # lines, text: not a blank canvas


def test_compare_starts_both_servers_and_prints_the_table(llama_dir, tmp_path, capsys):
    out = tmp_path / "compare.json"
    assert main(["bench", "compare", "--model", str(llama_dir), "--num-prompts", "6", "--concurrency", "3",
                 "--output-len", "8", "--single-output-len", "24", "--single-repeat", "2", "--no-progress",
                 "--serve-args", "--num-kv-blocks 128", "--result-json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| | hf-baseline | llmaccel | improvement |" in table
    assert "mean latency, 1 request x 24 tokens (s)" in table and "QPS at concurrency 3 (6 x 8 tokens)" in table
    systems = json.loads(out.read_text())["systems"]
    assert [s["label"] for s in systems] == ["hf-baseline", "llmaccel"]
    for s in systems:
        assert s["single"]["completed"] == 2 and s["single"]["total_output_tokens"] == 48
        assert s["concurrent"]["completed"] == 6 and s["concurrent"]["total_output_tokens"] == 48
        assert s["concurrent"]["failed"] == 0 and s["peak_rss_bytes"] > 50 * 2**20
        assert 50 * 2**20 < s["load_rss_bytes"] <= s["peak_rss_bytes"]
        # the bandwidth read before and after each lone request, each after the one before it; each request's rate
        beside = s["single"]["read_bandwidth_gbps_beside"]
        assert len(beside) == 2 and beside[0][1] == beside[1][0]
        assert [round(r, 6) for r in s["single"]["request_output_throughput"]] == [
            round(24 / e, 6) for e in s["single"]["e2els"]]
    assert systems[0]["single"]["ceiling_share"] is None  # the HF baseline does not say its weight bytes
    share = systems[1]["single"]["ceiling_share"]  # llmaccel reports its own on /metrics
    assert share == ceiling_share(systems[1]["single"], share["weight_bytes"]) and share["weight_bytes"] > 0


def test_ceiling_share_holds_each_repeat_against_the_readings_either_side():
    single = {"read_bandwidth_gbps_beside": [[30.0, 40.0], [40.0, 50.0]], "request_output_throughput": [100.0, 200.0],
              "output_throughput": 150.0}
    share = ceiling_share(single, 10**8)
    assert share == {"weight_bytes": 10**8, "median": pytest.approx((100 / 350 + 200 / 450) / 2),
                     "lowest": pytest.approx(100 / 350), "highest": pytest.approx(200 / 450),
                     "against_best_reading": pytest.approx(150e8 / 50e9)}
    assert ceiling_share(single, None) is None
    assert ceiling_share({**single, "request_output_throughput": [None, None]}, 10**8) is None  # both failed


def test_sweep_over_concurrency_writes_results_and_plots(llama_dir, tmp_path, capsys):
    with live_server(llama_dir) as server:
        assert main(["bench", "sweep", "--base-url", server.url, "--tokenizer", str(llama_dir), "--concurrency", "1,4",
                     "--num-prompts", "4", "--dataset", "random", "--input-len", "16", "--output-len", "6",
                     "--ignore-eos", "--result-dir", str(tmp_path), "--label", "tiny"]) == 0
    results = sorted(tmp_path.glob("tiny-c*.json"))
    assert [p.name for p in results] == ["tiny-c1.json", "tiny-c4.json"]
    c4 = json.loads(results[1].read_text())
    assert c4["max_concurrency"] == 4 and c4["completed"] == 8 and c4["total_output_tokens"] == 48
    table = capsys.readouterr().out
    assert table.count("| tiny |") == 2
    assert_real_png(tmp_path / "serve-throughput.png")
    assert_real_png(tmp_path / "serve-latency.png")


def fake_result(label: str, concurrency: int, throughput: float) -> dict:
    result = {"label": label, "max_concurrency": concurrency, "request_rate": float("inf"), "failed": 0,
              "request_throughput": throughput / 64, "output_throughput": throughput, "mean_e2el_ms": 4000.0}
    for metric, base in (("ttft", 200.0), ("tpot", 40.0), ("itl", 40.0)):
        result[f"median_{metric}_ms"] = base * (1 + concurrency / 16)
        result[f"p99_{metric}_ms"] = base * (2 + concurrency / 8)
    return result


def test_plot_draws_one_line_per_server(tmp_path):
    results = [fake_result("llmaccel", c, t) for c, t in ((1, 30.0), (4, 100.0), (16, 220.0), (64, 330.0))]
    results += [fake_result("hf-baseline", c, 17.0) for c in (1, 4, 16)]
    files = []
    for i, r in enumerate(results):
        files.append(tmp_path / f"r{i}.json")
        files[-1].write_text(json.dumps(r))
    assert main(["bench", "plot", *map(str, files), "--out-dir", str(tmp_path / "img"), "--prefix", "cmp"]) == 0
    assert_real_png(tmp_path / "img" / "cmp-throughput.png")
    assert_real_png(tmp_path / "img" / "cmp-latency.png")
    table = plot_results(results, tmp_path / "img2")
    assert table.count("| llmaccel |") == 4 and table.count("| hf-baseline |") == 3
    assert "| llmaccel | 64 | 5.16 | 330.0 | 1000 |" in table


def test_plot_names_a_bad_result_file(tmp_path, capsys):
    assert main(["bench", "plot", str(tmp_path / "missing.json")]) == 2
    (tmp_path / "other.json").write_text('{"a": 1}')
    assert main(["bench", "plot", str(tmp_path / "other.json")]) == 2
    err = capsys.readouterr().err
    assert "missing.json: cannot read a result file" in err and "other.json: not a bench serve result" in err


def test_compare_runs_variants_and_started_peers_one_at_a_time(llama_dir, tmp_path, capsys):
    """A peer given as a command is started by compare itself (here llmaccel's own server stands in for
    llama.cpp / vLLM), measured with the same requests, stopped; the file records machine and commands."""
    out = tmp_path / "peers.json"
    peer = f"{sys.executable} -m llmaccel.cli serve --model {llama_dir} --num-kv-blocks 64"
    assert main(["bench", "compare", "--model", str(llama_dir), "--num-prompts", "4", "--concurrency", "2",
                 "--output-len", "6", "--single-output-len", "10", "--single-repeat", "1", "--no-progress",
                 "--skip-baseline", "--skip-llmaccel", "--variant", "tiny-int8=--quantization int8 --num-kv-blocks 64",
                 "--peer-command", f"stand-in={peer}", "--weight-bytes", "stand-in=1e6",
                 "--result-json", str(out)]) == 0
    assert "| | tiny-int8 | stand-in |" in capsys.readouterr().out
    record = json.loads(out.read_text())
    assert [s["label"] for s in record["systems"]] == ["tiny-int8", "stand-in"]
    assert record["commands"]["stand-in"][-2:] == ["--num-kv-blocks", "64"]
    assert record["machine"]["cpu"] and record["machine"]["read_bandwidth_gbps"] > 0
    assert all(len(s["single"]["read_bandwidth_gbps_beside"]) == 1 for s in record["systems"])
    assert [s["paired_with"] for s in record["systems"]] == [[], []]  # one server at a time
    assert record["systems"][1]["single"]["ceiling_share"]["weight_bytes"] == 10**6  # the flag over /metrics
    for s in record["systems"]:
        assert s["single"]["total_output_tokens"] == 10 and s["concurrent"]["total_output_tokens"] == 24
        assert s["start_seconds"] > 0 and s["peak_rss_bytes"] > 50 * 2**20


def test_paired_servers_run_side_by_side_and_take_turns_at_the_lone_request(llama_dir, tmp_path, capsys):
    """--paired: a variant and its peer are up together; their lone requests alternate A B, B A, so each
    request's bandwidth reading after it is the next request's reading before it, across the two servers."""
    out = tmp_path / "paired.json"
    peer = f"{sys.executable} -m llmaccel.cli serve --model {llama_dir} --num-kv-blocks 64"
    assert main(["bench", "compare", "--model", str(llama_dir), "--num-prompts", "2", "--concurrency", "2",
                 "--output-len", "4", "--single-output-len", "6", "--single-repeat", "2", "--no-progress",
                 "--skip-baseline", "--skip-llmaccel", "--interleave", "--paired",
                 "--variant", "ours=--num-kv-blocks 64", "--peer-command", f"theirs={peer}",
                 "--result-json", str(out)]) == 0
    ours, theirs = json.loads(out.read_text())["systems"]
    assert (ours["label"], ours["paired_with"], theirs["label"], theirs["paired_with"]) == (
        "ours", ["theirs"], "theirs", ["ours"])
    a, b = ours["single"]["read_bandwidth_gbps_beside"], theirs["single"]["read_bandwidth_gbps_beside"]
    assert a[0][1] == b[0][0] and b[0][1] == b[1][0] and b[1][1] == a[1][0]  # A, B, then B, A
    for s in (ours, theirs):
        assert s["single"]["total_output_tokens"] == 12 and s["concurrent"]["total_output_tokens"] == 8
        assert s["start_seconds"] > 0 and s["load_rss_bytes"] <= s["peak_rss_bytes"]
    rates = [s["single"]["request_output_throughput"] for s in (ours, theirs)]
    assert paired_leads([ours, theirs]) == {"theirs": statistics.median(a / b for a, b in zip(*rates, strict=True))}
    assert "| 1 request side by side: the first of its group over this" in capsys.readouterr().out


def test_a_pair_that_would_not_fit_in_memory_runs_one_after_the_other(llama_dir, tmp_path, capsys):
    out = tmp_path / "apart.json"
    peer = f"{sys.executable} -m llmaccel.cli serve --model {llama_dir} --num-kv-blocks 64"
    assert main(["bench", "compare", "--model", str(llama_dir), "--num-prompts", "2", "--concurrency", "2",
                 "--output-len", "4", "--single-output-len", "6", "--single-repeat", "1", "--no-progress",
                 "--skip-baseline", "--skip-llmaccel", "--interleave", "--paired",
                 "--variant", "ours=--num-kv-blocks 64", "--peer-command", f"huge={peer}",
                 "--weight-bytes", "huge=1e15", "--result-json", str(out)]) == 0
    assert "huge does not fit beside ours: measured after it" in capsys.readouterr().err
    systems = json.loads(out.read_text())["systems"]
    assert [(s["label"], s["paired_with"]) for s in systems] == [("ours", []), ("huge", [])]
    assert all(s["single"]["total_output_tokens"] == 6 for s in systems)


def test_paired_needs_interleave(llama_dir, capsys):
    assert main(["bench", "compare", "--model", str(llama_dir), "--skip-baseline", "--paired"]) == 2
    assert "--paired takes its pairs from --interleave" in capsys.readouterr().err


def test_peak_memory_counts_the_processes_a_server_starts():
    """vLLM's server holds the model in an engine process it starts: its peak is in the sum."""
    child = "b = bytearray(200 * 2**20); import time; time.sleep(30)"
    parent = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", parent])
    try:
        deadline = time.monotonic() + 20
        while (peak_rss_bytes(proc.pid) or 0) < 200 * 2**20 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert peak_rss_bytes(proc.pid) > 200 * 2**20  # the parent alone holds ~10 MB
        assert len(_process_tree(proc.pid)) == 2
    finally:
        for pid in reversed(_process_tree(proc.pid)):
            os.kill(pid, signal.SIGKILL)
        proc.wait()


def test_a_peer_that_dies_at_start_is_recorded_and_the_others_are_still_measured(llama_dir, tmp_path, capsys):
    """llama.cpp's AMX path crashed at start on one machine: the run keeps every other server's figures."""
    out = tmp_path / "peers.json"
    dying = f"{sys.executable} -c \"import sys; print('crashed in warm-up'); sys.exit(139)\""
    assert main(["bench", "compare", "--model", str(llama_dir), "--num-prompts", "2", "--concurrency", "2",
                 "--output-len", "4", "--single-output-len", "6", "--single-repeat", "1", "--no-progress",
                 "--skip-baseline", "--serve-args", "--num-kv-blocks 64", "--peer-command", f"dies={dying}",
                 "--result-json", str(out)]) == 0
    captured = capsys.readouterr()
    assert "| | llmaccel |" in captured.out and "did not start (see the result JSON): dies" in captured.out
    assert "dies did not start; measuring the others" in captured.err
    systems = json.loads(out.read_text())["systems"]
    assert [s["label"] for s in systems] == ["llmaccel", "dies"]
    assert systems[0]["single"]["total_output_tokens"] == 6
    assert "did not come up" in systems[1]["failed_to_start"] and "crashed in warm-up" in systems[1]["failed_to_start"]


def test_compare_names_a_malformed_peer(llama_dir, capsys):
    assert main(["bench", "compare", "--model", str(llama_dir), "--skip-baseline", "--skip-llmaccel",
                 "--peer-command", "no label here"]) == 2
    assert "'no label here': write LABEL=..." in capsys.readouterr().err


def test_weight_bytes_that_are_not_a_positive_number_are_refused(capsys):
    for bad in ("peer=lots", "peer=-5", "peer="):
        assert main(["bench", "compare", "--weight-bytes", bad, "--skip-baseline", "--skip-llmaccel"]) == 2
        assert f"--weight-bytes {bad!r}: BYTES must be a positive number" in capsys.readouterr().err
