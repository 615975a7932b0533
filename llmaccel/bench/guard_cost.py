"""`llmaccel bench guard-cost`: what the in-engine semantic guard costs a loaded server, in one run.

Two `llmaccel serve` processes of the same model, one with the rules alone (`--semantic-guard off`), one
with the rules and the semantic guard (its classifier for the model, action count, so that no request
of the load is refused). Each round runs `bench serve` at the concurrency against each, and against the
rules-alone server a second time (the null arm: what noise alone gives), in rotated order; one server
is measured at a time, the other idle. Reported: output tok/s per arm and the paired ratios against the
rules alone, with seeded bootstrap intervals (bench/paired.py); and the time from a request's arrival to the
guard's verdict on its prompt under that load, p50/p99, from the guarded server's histogram over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

ARMS = ("rules alone", "rules alone again", "rules + semantic guard")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="the model both servers serve")
    parser.add_argument("--semantic-guard", default="default", metavar="F",
                        help="the classifier the guarded server runs ('default': the one for --model)")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests per measurement")
    parser.add_argument("--output-len", type=int, default=128, help="tokens generated per request (EOS ignored)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of the three arms")
    parser.add_argument("--result-json", type=Path, help="write every run and the summary here")


def _bench(url: str, model: str, label: str, args: argparse.Namespace) -> dict:
    from llmaccel.bench.serve import benchmark_args, run_benchmark, sample_requests, tokenizer_for

    bench_args = benchmark_args(url, label, "--model", model, "--num-prompts", str(args.num_prompts),
                                "--output-len", str(args.output_len))
    tokenizer = tokenizer_for(bench_args)
    requests = sample_requests(bench_args, tokenizer)
    return asyncio.run(run_benchmark(bench_args, requests, tokenizer, float("inf"), args.concurrency, progress=False))


def run(args: argparse.Namespace) -> int:
    import httpx

    from llmaccel.bench.paired import markdown_table, paired_summary, rotated
    from llmaccel.bench.servers import free_port, start_server, stop_server
    from llmaccel.platform import describe

    if args.rounds < 2 or args.concurrency < 1 or args.num_prompts < 1:
        raise ValueError("--rounds needs at least 2, --concurrency and --num-prompts at least 1")
    servers = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for name, flags in (("off", ["--semantic-guard", "off"]),
                                ("on", ["--semantic-guard", args.semantic_guard, "--semantic-guard-action", "count"])):
                port = free_port()
                command = [sys.executable, "-m", "llmaccel.cli", "serve", "--model", args.model, "--no-result-cache",
                           *flags]
                servers[name] = (start_server(command, port, Path(tmp) / f"{name}.log", timeout=900),
                                 f"http://127.0.0.1:{port}")
            urls = {"rules alone": servers["off"][1], "rules alone again": servers["off"][1],
                    "rules + semantic guard": servers["on"][1]}
            for url in set(urls.values()):
                _bench(url, args.model, "warm-up", argparse.Namespace(**{**vars(args), "output_len": 16}))
            before = _verdict_buckets(httpx.get(servers["on"][1] + "/metrics").text)
            runs: dict[str, list[float]] = {arm: [] for arm in ARMS}
            failures = 0
            for round_index in range(args.rounds):
                for arm in rotated(ARMS, round_index):
                    result = _bench(urls[arm], args.model, arm, args)
                    runs[arm].append(result["output_throughput"])
                    failures += result.get("failed", 0)
                    print(f"round {round_index + 1} {arm}: {result['output_throughput']:.1f} tok/s", file=sys.stderr)
            verdicts = httpx.get(servers["on"][1] + "/metrics").text
        finally:
            for proc, _ in servers.values():
                stop_server(proc)
    judged = [line for line in verdicts.splitlines() if line.startswith("llmaccel_semantic_guard_verdicts_total")]
    if not judged:
        raise ValueError(f"the guarded server ran no semantic guard: no classifier for {args.model}? "
                         "(train one: llmaccel safety train-guard)")
    summary = paired_summary(runs, "rules alone")
    latency = verdict_latency(before, _verdict_buckets(verdicts))
    print(markdown_table(runs, summary, "rules alone", "output tok/s"))
    print("\n".join(judged))
    print(f"time to a verdict under load ({latency['count']} prompts): p50 {latency['p50_ms']:.0f} ms, "
          f"p99 {latency['p99_ms']:.0f} ms")
    if failures:
        print(f"{failures} requests failed", file=sys.stderr)
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps({
            "machine": describe(), "model": args.model, "concurrency": args.concurrency,
            "num_prompts": args.num_prompts, "output_len": args.output_len, "runs": runs,
            "against_rules_alone": summary, "verdicts": judged, "verdict_latency": latency,
            "failed_requests": failures}, indent=1) + "\n")
    return 0 if not failures else 1


def _verdict_buckets(text: str) -> dict[float, float]:
    """The guard's verdict-time histogram in a /metrics page: cumulative count by upper bound."""
    from llmaccel.server.metrics import parse_metrics
    from llmaccel.server.stats import histogram_buckets

    return dict(histogram_buckets(parse_metrics(text), "semantic_guard_verdict_seconds"))


def verdict_latency(before: dict[float, float], after: dict[float, float]) -> dict[str, float]:
    """p50 and p99 (ms) of the verdicts between two scrapes, interpolated within buckets as Prometheus does."""
    from llmaccel.server.stats import histogram_quantile

    delta = sorted((bound, count - before.get(bound, 0.0)) for bound, count in after.items())
    count = delta[-1][1] if delta else 0.0
    p50, p99 = histogram_quantile(0.5, delta), histogram_quantile(0.99, delta)
    return {"count": int(count), "p50_ms": 1000 * (p50 or 0.0), "p99_ms": 1000 * (p99 or 0.0)}
