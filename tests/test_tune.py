"""`llmaccel tune`: SLO strings, the SLO check on a run's per-request data, the search on a planted optimum,
`serve --config` files, and the whole command against tiny-model servers (a fresh server from the written
file included)."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from llmaccel.cli import _with_config_files, build_parser, main
from llmaccel.config_file import write_config_file
from llmaccel.tune import report
from llmaccel.tune.search import (
    Candidate,
    CandidateResult,
    RatePoint,
    SearchSpace,
    best_result,
    coordinate_search,
    rate_search,
)
from llmaccel.tune.slo import Objective, SLOCheck, check, parse_slo


def test_slo_strings_parse_with_units():
    assert parse_slo("ttft_p99<=1s,tpot_p99<=100ms") == (Objective("ttft", "p99", 1000.0),
                                                          Objective("tpot", "p99", 100.0))
    assert parse_slo(" e2el_mean <= 2.5s , itl_p99.9<=500us, ttft_p50<=250 ") == (
        Objective("e2el", "mean", 2500.0), Objective("itl", "p99.9", 0.5), Objective("ttft", "p50", 250.0))


@pytest.mark.parametrize("text, message", [
    ("", "empty"),
    ("ttft<=1s", "METRIC_STAT<=LIMIT"),
    ("ttfb_p99<=1s", "unknown metric 'ttfb'"),
    ("ttft_p99>=1s", "METRIC_STAT<=LIMIT"),
    ("ttft_p99<=1h", "METRIC_STAT<=LIMIT"),
    ("ttft_p0<=1s", r"percentile must be in \(0, 100\]"),
    ("ttft_p101<=1s", r"percentile must be in \(0, 100\]"),
    ("ttft_p99<=0ms", "positive"),
    ("ttft_p99<=-1s", "positive"),
    ("ttft_p99<=1.2.3s", "not a number"),
    ("ttft_p99<=1s,ttft_p99<=2s", "twice"),
])
def test_bad_slo_strings_are_named_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_slo(text)


def run_result(ttfts, e2els, output_lens, errors=None, duration=10.0) -> dict:
    """A bench serve result's per-request fields, as run_benchmark writes them (seconds)."""
    itls = [[(e - t) / (n - 1)] * (n - 1) if n > 1 else [] for t, e, n in zip(ttfts, e2els, output_lens, strict=True)]
    return {"ttfts": ttfts, "e2els": e2els, "output_lens": output_lens, "itls": itls,
            "errors": errors or [""] * len(ttfts), "duration_s": duration}


def test_slo_check_on_a_run():
    # four requests: TTFT 0.1, 0.2, 0.3, 0.9 s; 11 tokens each, so TPOT (e2el - ttft) / 10
    result = run_result([0.1, 0.2, 0.3, 0.9], [0.6, 0.7, 2.3, 1.4], [11, 11, 11, 11])
    outcome = check(result, parse_slo("ttft_p50<=300ms,tpot_p100<=100ms"))
    assert outcome.values_ms == pytest.approx({"ttft_p50": 250.0, "tpot_p100": 200.0})
    assert not outcome.met and outcome.worst_ratio == pytest.approx(2.0)
    # goodput counts the requests that met every limit themselves: 1 and 2 (3 has TPOT 200 ms, 4 TTFT 900 ms)
    assert outcome.goodput == pytest.approx(2 / 10.0)
    loose = check(result, parse_slo("ttft_p100<=1s,tpot_mean<=100ms"))
    assert loose.met and loose.values_ms["tpot_mean"] == pytest.approx(87.5)
    failed = run_result([0.1, 0.2], [0.6, 0.7], [11, 11], errors=["", "HTTP 503: overloaded"])
    assert not check(failed, parse_slo("ttft_p100<=1s")).met  # a failed request fails the run


def planted_server(capacity: dict[Candidate, float]):
    """A configuration's server as a queue: it meets the SLO while the arrival rate stays under 80% of its
    capacity, and serves min(rate, capacity); the worst value/limit ratio grows as the rate nears capacity."""
    runs: list[tuple[Candidate, float]] = []

    def run_candidate(candidate: Candidate, beat: float | None) -> CandidateResult:
        cap = capacity[candidate]

        def measure(rate: float) -> RatePoint:
            runs.append((candidate, rate))
            served = min(rate, cap)
            ratio = 0.5 / max(1e-9, 1 - min(rate, 10 * cap) / (cap * 1.6)) if rate < 1.6 * cap else 10.0
            return RatePoint(rate, served, SLOCheck(met=rate <= 0.8 * cap, values_ms={"ttft_p99": ratio * 1000},
                                                    worst_ratio=ratio, goodput=served))

        points, pruned = rate_search(measure, beat, steps=4)
        return CandidateResult(candidate, points, pruned)

    return run_candidate, runs


def test_search_finds_a_planted_optimum_and_prunes_the_rest():
    space = SearchSpace(max_num_seqs=(16, 32, 64, 128, 256), max_num_batched_tokens=(512, 1024, 2048, 4096),
                        variants=("default", "bf16", "int8"))
    seqs_gain = {16: 0.5, 32: 0.8, 64: 1.0, 128: 0.9, 256: 0.7}
    tokens_gain = {512: 0.85, 1024: 1.0, 2048: 0.95, 4096: 0.8}
    variant_gain = {"default": 1.0, "bf16": 1.0, "int8": 1.3}
    capacity = {Candidate(s, t, v): 10 * seqs_gain[s] * tokens_gain[t] * variant_gain[v]
                for s in seqs_gain for t in tokens_gain for v in variant_gain}
    run_candidate, runs = planted_server(capacity)
    results = coordinate_search(space, Candidate(128, 2048), run_candidate)
    best = best_result(results)
    assert best.candidate == Candidate(64, 1024, "int8")
    assert results[0].candidate == Candidate(128, 2048)  # the defaults first, as the baseline of the ratio
    # the planted capacity is 13 req/s; met while the rate <= 0.8 x 13 = 10.4: the bisection ends within it
    assert 9.0 < best.goodput <= 10.4
    assert best.goodput / results[0].goodput > 1.4
    assert len(results) < len(capacity) and any(r.pruned for r in results)
    pruned = [r for r in results if r.pruned]
    assert all(len(r.points) == 1 and not r.points[0].check.met for r in pruned)  # a loser costs one run


def test_a_search_that_meets_nothing_says_how_close_it_came():
    def run_candidate(candidate, beat):
        ratio = 1.4 if candidate.max_num_seqs == 64 else 2.0
        point = RatePoint(math.inf, 3.0, SLOCheck(False, {"ttft_p99": 1000 * ratio}, ratio, 0.0))
        return CandidateResult(candidate, [point])

    results = coordinate_search(SearchSpace((32, 64), (2048,)), Candidate(128, 2048), run_candidate)
    assert best_result(results) is None
    text = report.closest_text(results, parse_slo("ttft_p99<=1s"))
    assert "seqs=64 tokens=2048 at all at once: ttft_p99 1400 ms against 1000 ms (1.40x" in text


def test_config_file_flags_and_the_command_line_winning(tmp_path):
    path = tmp_path / "tuned.yaml"
    write_config_file(path, {"model": "smollm2-135m", "max_num_seqs": 64, "max_num_batched_tokens": 1024,
                             "quantization": "int8", "no_prefix_caching": False, "served_model_name": ["a", "b"]},
                      comment="from a test")
    text = path.read_text()
    assert text.startswith("# from a test\n") and "max-num-seqs: 64" in text
    parser = build_parser()
    args = parser.parse_args(_with_config_files(parser, ["serve", "--config", str(path), "--max-num-seqs", "8"]))
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.quantization) == (8, 1024, "int8")
    assert args.served_model_name == ["a", "b"] and args.no_prefix_caching is False
    args = parser.parse_args(_with_config_files(parser, ["--log-level", "INFO", "serve", f"--config={path}"]))
    assert args.max_num_seqs == 64


@pytest.mark.parametrize("content, message", [
    ("max-num-seqs: [1, 2]\n", "takes one value, not a list"),
    ("enable-prefix-caching: true\n", "not a flag of llmaccel serve (did you mean no-prefix-caching?)"),
    ("no-ui: yes please\n", "is a switch; write true or false"),
    ("- max-num-seqs\n", "expected a mapping"),
    ("max-num-seqs: [\n", "not valid YAML"),
])
def test_bad_config_files_are_named_errors(tmp_path, capsys, content, message):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    assert main(["serve", "--config", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_a_config_value_the_flag_refuses_fails_as_the_flag_would(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("quantization: int3\n")
    with pytest.raises(SystemExit):
        main(["serve", "--config", str(path)])
    assert "--quantization: invalid choice: 'int3'" in capsys.readouterr().err
    assert main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read it" in capsys.readouterr().err


def test_tune_on_a_tiny_model_writes_a_config_that_serves_again(tmp_path, llama_dir, capsys):
    """The whole command against real tiny-model servers: two values per flag, a loose SLO every run meets,
    the winner written and served again, fresh, from its file."""
    output = tmp_path / "tuned.yaml"
    code = main(["tune", "--model", str(llama_dir), "--slo", "e2el_p99<=120s", "--dataset", "builtin",
                 "--output-len", "8", "--ignore-eos", "--num-prompts", "6",
                 "--max-num-seqs", "2,8", "--max-num-batched-tokens", "64", "--rate-steps", "1", "--passes", "1",
                 "--serve-args", "--num-kv-blocks 64 --no-ui", "--output", str(output),
                 "--result-dir", str(tmp_path / "results")])
    assert code == 0, capsys.readouterr().err
    record = json.loads((tmp_path / "results" / "tune.json").read_text())
    labels = [c["label"] for c in record["configurations"]]
    assert labels[0] == "seqs=128 tokens=2048" and len(labels) == 4  # the defaults, 2 x seqs, 1 x tokens
    assert labels[3].endswith("tokens=64") and all(run["failed"] == 0 and run["met"] for run in record["runs"])
    written = yaml.safe_load(output.read_text())
    assert written == {"model": str(llama_dir), **{k.replace("_", "-"): v for k, v in record["best"].items()}}
    assert record["verification"]["met"] and f"--config {output}" in record["verification"]["command"]
    if record["best"] != record["defaults"]:  # the defaults served fresh at the winner's rate
        assert record["head_to_head"]["rate"] == record["verification"]["rate"]
    assert (tmp_path / "results" / "tune-frontier.png").stat().st_size > 10_000


def test_rate_search_climbs_past_the_all_at_once_rate_then_bisects():
    """Paced arrivals can be served faster than a burst completes: met up to 12 req/s, a burst done at 10."""
    def measure(rate: float) -> RatePoint:
        met = math.isfinite(rate) and rate <= 12.0
        served = min(rate, 10.0)
        return RatePoint(rate, served, SLOCheck(met, {"ttft_p99": 0.0}, 0.5 if met else 2.0, served))

    points, pruned = rate_search(measure, None, steps=3)
    rates = [p.rate for p in points]
    assert rates[:4] == pytest.approx([math.inf, 10.0, 11.5, 13.225]) and not pruned
    result = CandidateResult(Candidate(), points)
    assert 11.7 < max(p.rate for p in points if p.check.met) <= 12.0 and len(points) == 7  # 3 bisections
    assert result.goodput == 10.0  # what it served, however fast the requests arrived
    points, pruned = rate_search(measure, 11.9, steps=3)  # probed at 12.5: cannot beat 11.9, costs one run
    assert pruned and [p.rate for p in points] == pytest.approx([11.9 * 1.05])
