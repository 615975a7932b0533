"""`bench serve`: the metric math on synthetic timestamps, datasets, and live runs against a tiny
llmaccel server (counts, JSON fields, failures kept with their errors)."""

from __future__ import annotations

import json

import pytest

from llmaccel.bench import datasets
from llmaccel.bench.serve_metrics import RequestResult, compute_metrics, parse_goodput, parse_percentiles
from llmaccel.bench.servers import free_port
from llmaccel.cli import main
from tests.live_server import live_server


def result(ttft: float, gaps: list[float], output_len: int | None = None, prompt_len: int = 10) -> RequestResult:
    return RequestResult(success=True, prompt_len=prompt_len, output_len=output_len or len(gaps) + 1, ttft=ttft,
                         latency=ttft + sum(gaps), itl=list(gaps))


def test_metric_math_on_synthetic_timestamps():
    results = [
        result(0.100, [0.010, 0.020, 0.030]),  # 4 tokens: e2el 0.160, tpot 0.020
        result(0.300, [0.050]),  # 2 tokens: e2el 0.350, tpot 0.050
        result(0.200, [], output_len=1),  # 1 token: no TPOT, no ITL
        RequestResult(success=False, error="HTTP 429: queue full"),
    ]
    m = compute_metrics(results, duration_s=2.0, percentiles=[50, 90], slos={"ttft": 250, "tpot": 30})
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 7
    assert m["request_throughput"] == pytest.approx(1.5) and m["output_throughput"] == pytest.approx(3.5)
    assert m["total_token_throughput"] == pytest.approx(18.5)
    assert m["mean_ttft_ms"] == pytest.approx(200) and m["median_ttft_ms"] == pytest.approx(200)
    assert m["std_ttft_ms"] == pytest.approx((2 * 100**2 / 3) ** 0.5)
    assert m["p90_ttft_ms"] == pytest.approx(280)  # numpy's linear interpolation between 200 and 300
    assert m["mean_tpot_ms"] == pytest.approx(35) and m["median_tpot_ms"] == pytest.approx(35)
    assert m["mean_itl_ms"] == pytest.approx(27.5) and m["median_itl_ms"] == pytest.approx(25)
    assert m["p50_itl_ms"] == pytest.approx(25)
    assert m["mean_e2el_ms"] == pytest.approx((160 + 350 + 200) / 3)
    # goodput: request 1 meets both SLOs; request 2 misses ttft; request 3 meets (no TPOT counts as 0)
    assert m["request_goodput"] == pytest.approx(2 / 2.0)


def test_no_successful_request_still_gives_a_report():
    m = compute_metrics([RequestResult(error="boom")] * 3, duration_s=1.0, percentiles=[99])
    assert m["completed"] == 0 and m["failed"] == 3 and m["mean_ttft_ms"] == 0 and "request_goodput" not in m


def test_goodput_and_percentile_arguments():
    assert parse_goodput(["ttft:500", "e2el:1e4"]) == {"ttft": 500.0, "e2el": 10000.0}
    for bad in (["ttft"], ["itl:5"], ["ttft:fast"], ["tpot:-1"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)
    assert parse_percentiles("50, 99.9") == [50.0, 99.9]
    with pytest.raises(ValueError, match="--percentiles"):
        parse_percentiles("0,50")


def test_sharegpt_file_cut_off_mid_item_keeps_the_complete_conversations(tmp_path, tiny_tokenizer):
    convs = [{"id": str(i), "conversations": [
        {"from": "human", "value": f"Please explain continuous batching number {i} in a few words."},
        {"from": "gpt", "value": "Continuous batching packs every active request into each forward pass. " * (i + 1)}]}
        for i in range(5)]
    text = json.dumps(convs, indent=1)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: text.index('"id": "4"') + 5])  # truncated inside the last item
    assert [c["id"] for c in datasets.read_sharegpt(path)] == ["0", "1", "2", "3"]
    requests = datasets.sharegpt_requests(path, tiny_tokenizer, 4)
    assert sorted(r.expected_output_len for r in requests) == sorted(
        len(tiny_tokenizer.encode(c["conversations"][1]["value"], add_special_tokens=False)) for c in convs[:4])
    with pytest.raises(ValueError, match="only 4 usable"):
        datasets.sharegpt_requests(path, tiny_tokenizer, 5)


def test_random_prompts_have_the_asked_lengths(tiny_tokenizer):
    requests = datasets.random_requests(tiny_tokenizer, 8, input_len=40, output_len=12, range_ratio=0.25, seed=1)
    assert len(requests) == 8 and all(9 <= r.expected_output_len <= 15 for r in requests)
    assert len({r.prompt for r in requests}) == 8


@pytest.fixture(scope="module")
def server(llama_dir):
    with live_server(llama_dir) as live:
        yield live


def run_bench(server, llama_dir, tmp_path, *extra: str) -> dict:
    out = tmp_path / "result.json"
    args = ["bench", "serve", "--base-url", server, "--tokenizer", str(llama_dir), "--result-json", str(out),
            "--no-progress", *extra]
    assert main(args) == 0
    return json.loads(out.read_text())


def test_bench_serve_against_a_live_server(server, llama_dir, tmp_path, capsys):
    res = run_bench(server.url, llama_dir, tmp_path, "--dataset", "random", "--num-prompts", "6", "--input-len", "24",
                    "--output-len", "10", "--ignore-eos", "--request-rate", "40", "--max-concurrency", "3",
                    "--goodput", "e2el:60000", "--label", "tiny-llmaccel")
    assert res["completed"] == 6 and res["failed"] == 0 and res["errors"] == [""] * 6
    assert res["total_output_tokens"] == 60 and res["output_lens"] == [10] * 6
    assert res["label"] == "tiny-llmaccel" and res["model"] == "tiny" and res["max_concurrency"] == 3
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90", "p99"):
            assert f"{stat}_{name}_ms" in res
    assert 0 < res["mean_ttft_ms"] < res["mean_e2el_ms"]
    assert all(len(gaps) >= 1 for gaps in res["itls"])
    assert "Serving Benchmark Result" in capsys.readouterr().out
    server.wait_idle()


def test_refused_requests_are_counted_with_their_errors(server, llama_dir, tmp_path):
    res = run_bench(server.url, llama_dir, tmp_path, "--dataset", "random", "--num-prompts", "4", "--input-len", "16",
                    "--output-len", "1100")  # over the tiny model's 1024-token window: every request gets a 400
    assert res["completed"] == 0 and res["failed"] == 4
    assert all(e.startswith("HTTP 400: this model's maximum context length is 1024") for e in res["errors"])


def test_an_unreachable_server_still_ends_with_a_report(llama_dir, tmp_path, capsys):
    port = free_port()  # nothing listens here
    res = run_bench(f"http://127.0.0.1:{port}", llama_dir, tmp_path, "--model", "tiny", "--num-prompts", "3")
    assert res["failed"] == 3 and all(e.startswith("ClientConnectorError") for e in res["errors"])
    assert "Errors" in capsys.readouterr().out
