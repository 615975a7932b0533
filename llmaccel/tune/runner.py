"""The tuner's measurements: a server per configuration, bench serve runs at the rates the search asks for,
every run with the same prompts (RunPrompts)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

from llmaccel.bench import serve as bench_serve
from llmaccel.bench.datasets import SampleRequest
from llmaccel.bench.servers import free_port, start_server, stop_server
from llmaccel.tune.search import Candidate, CandidateResult, RatePoint, rate_search
from llmaccel.tune.slo import Objective, check


class RunPrompts:
    """The prompts of every run: one set, shuffled once, so runs at other rates and on other configurations are
    paired (same prompts, same arrival times). Run k of a server tags each prompt with "#k:" at its start, so no
    run finds its prompts in the prefix cache a run before it filled (the shared chat-template prefix still
    hits, as it does in serving)."""

    def __init__(self, pool: list[SampleRequest], size: int, seed: int = 0) -> None:
        if size < 1:
            raise ValueError("--num-prompts must be >= 1")
        if len(pool) < size + 4:
            raise ValueError(f"the dataset has {len(pool)} prompts; --num-prompts {size} needs {size + 4} (4 warm "
                             "the server)")
        shuffled = list(pool)
        random.Random(seed).shuffle(shuffled)
        self.measured, self.warm_up = shuffled[:size], shuffled[size:size + 4]

    def run(self, index: int) -> list[SampleRequest]:
        return [replace(r, prompt=f"#{index}: {r.prompt}", prompt_len=r.prompt_len + 3) for r in self.measured]


def serve_command(model: str, candidate: Candidate, extra: list[str]) -> list[str]:
    """llmaccel serve with the candidate's flags; no result cache (it would answer repeats without the engine)."""
    return [sys.executable, "-m", "llmaccel.cli", "serve", "--model", model, "--no-result-cache",
            *candidate.flags(), *extra]


@contextlib.contextmanager
def served(command: list[str], log: Path) -> Iterator[str]:
    """A server started with `command` for the block's duration; yields its base URL."""
    port = free_port()
    proc = start_server(command, port, log)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_server(proc)


def config_command(config: Path, serve_args: str) -> list[str]:
    """`llmaccel serve --config FILE` (what a user runs with the tuner's file), result cache off as in the search."""
    return [sys.executable, "-m", "llmaccel.cli", "serve", "--config", str(config), "--no-result-cache",
            *serve_args.split()]


def measure_at(url: str, args: argparse.Namespace, tokenizer, requests: list[SampleRequest], rate: float,
               objectives: tuple[Objective, ...], label: str) -> tuple[RatePoint, dict]:
    """One bench serve run at an arrival rate; its point for the search and its full result."""
    bench_args = bench_serve.benchmark_args(url, label, "--seed", str(args.seed),
                                            "--burstiness", str(args.burstiness))
    bench_args.ignore_eos = args.ignore_eos
    result = asyncio.run(bench_serve.run_benchmark(bench_args, requests, tokenizer, rate, None, progress=False))
    outcome = check(result, objectives)
    return RatePoint(rate=rate, throughput=result["request_throughput"], check=outcome), result


def candidate_runner(args: argparse.Namespace, tokenizer, prompts: RunPrompts, objectives: tuple[Objective, ...],
                     logs: Path, runs: list[dict], on_run: Callable[[str], None]
                     ) -> Callable[[Candidate, float | None], CandidateResult]:
    """The search's `run_candidate`: start the server, warm it, search its rates, stop it."""
    extra = args.serve_args.split() if args.serve_args else []

    def run_candidate(candidate: Candidate, beat: float | None) -> CandidateResult:
        label = str(candidate)
        log = logs / f"{_slug(label)}.log"
        try:
            with served(serve_command(args.model, candidate, extra), log) as url:
                measure_at(url, args, tokenizer, prompts.warm_up, math.inf, objectives, label)
                count = 0

                def measure(rate: float) -> RatePoint:
                    nonlocal count
                    point, result = measure_at(url, args, tokenizer, prompts.run(count), rate, objectives, label)
                    count += 1
                    runs.append({"candidate": candidate.config(), "label": label, **_run_summary(point, result)})
                    on_run(f"{label} @ {_rate_text(rate)}: {point.throughput:.2f} req/s, "
                           f"{'met' if point.check.met else 'missed'} ({_values_text(point)})")
                    return point

                # the first configuration (the defaults) sets the bar every later one is probed at: two more steps
                steps = args.rate_steps + (2 if beat is None else 0)
                points, pruned = rate_search(measure, beat, steps=steps, margin=args.margin)
        except RuntimeError as exc:  # a configuration the server refuses (e.g. no memory) loses, the search goes on
            on_run(f"{label}: the server did not start ({str(exc).splitlines()[0]}); see {log}")
            return CandidateResult(candidate)
        return CandidateResult(candidate, points, pruned)

    return run_candidate


def _run_summary(point: RatePoint, result: dict) -> dict:
    keep = ("request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
            "p99_tpot_ms", "p99_itl_ms", "failed", "duration_s")
    return {"rate": point.rate if math.isfinite(point.rate) else "inf", "met": point.check.met,
            "worst_ratio": point.check.worst_ratio, "slo_values_ms": point.check.values_ms,
            "goodput_requests_per_s": point.check.goodput, **{k: result.get(k) for k in keep},
            "errors": sorted({error for error in result["errors"] if error})[:5]}


def _rate_text(rate: float) -> str:
    return "all at once" if math.isinf(rate) else f"{rate:.2f} req/s"


def _values_text(point: RatePoint) -> str:
    return ", ".join(f"{name} {value:.0f} ms" for name, value in point.check.values_ms.items())


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text)
