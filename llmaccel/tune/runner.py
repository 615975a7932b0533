"""The tuner's measurements: a server per configuration, bench serve runs at the rates the search asks for.

Each run on a server takes the next unused slice of the prompt pool, so no run finds its prompts in the
prefix cache a run before it filled (the server keeps its prefix cache on, as it would serve), and run k of
every configuration sends the same prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from llmaccel.bench import serve as bench_serve
from llmaccel.bench.datasets import SampleRequest
from llmaccel.bench.servers import free_port, start_server, stop_server
from llmaccel.tune.search import Candidate, CandidateResult, RatePoint, rate_search
from llmaccel.tune.slo import Objective, check


class PromptSlices:
    """Disjoint slices of a shuffled prompt pool: slice k for a server's k-th run."""

    def __init__(self, pool: list[SampleRequest], size: int, seed: int = 0) -> None:
        if size < 1:
            raise ValueError("--num-prompts must be >= 1")
        if len(pool) < size:
            raise ValueError(f"the dataset has {len(pool)} prompts; --num-prompts {size} asks for more")
        self.pool = list(pool)
        random.Random(seed).shuffle(self.pool)
        self.size = size

    @property
    def count(self) -> int:
        return len(self.pool) // self.size

    def slice(self, index: int) -> list[SampleRequest]:
        """The index-th slice; past the last one they repeat (the prefix cache may then help)."""
        start = (index % self.count) * self.size
        return self.pool[start:start + self.size]


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


def config_served(config: Path, serve_args: str, log: Path) -> contextlib.AbstractContextManager[str]:
    """`llmaccel serve --config FILE` (what a user runs with the tuner's file), result cache off as in the search."""
    command = [sys.executable, "-m", "llmaccel.cli", "serve", "--config", str(config), "--no-result-cache",
               *serve_args.split()]
    return served(command, log)


def measure_at(url: str, args: argparse.Namespace, tokenizer, requests: list[SampleRequest], rate: float,
               objectives: tuple[Objective, ...], label: str) -> tuple[RatePoint, dict]:
    """One bench serve run at an arrival rate; its point for the search and its full result."""
    bench_args = bench_serve.benchmark_args(url, label, "--seed", str(args.seed),
                                            "--burstiness", str(args.burstiness))
    bench_args.ignore_eos = args.ignore_eos
    result = asyncio.run(bench_serve.run_benchmark(bench_args, requests, tokenizer, rate, None, progress=False))
    outcome = check(result, objectives)
    return RatePoint(rate=rate, throughput=result["request_throughput"], check=outcome), result


def candidate_runner(args: argparse.Namespace, tokenizer, slices: PromptSlices, objectives: tuple[Objective, ...],
                     logs: Path, runs: list[dict], on_run: Callable[[str], None]
                     ) -> Callable[[Candidate, float | None], CandidateResult]:
    """The search's `run_candidate`: start the server, warm it, search its rates, stop it."""
    extra = args.serve_args.split() if args.serve_args else []

    def run_candidate(candidate: Candidate, beat: float | None) -> CandidateResult:
        label = str(candidate)
        log = logs / f"{_slug(label)}.log"
        try:
            with served(serve_command(args.model, candidate, extra), log) as url:
                warm = slices.slice(slices.count - 1)[:4]  # the last slice: the search's runs take the first ones
                measure_at(url, args, tokenizer, warm, math.inf, objectives, label)
                count = 0

                def measure(rate: float) -> RatePoint:
                    nonlocal count
                    point, result = measure_at(url, args, tokenizer, slices.slice(count), rate, objectives, label)
                    count += 1
                    runs.append({"candidate": candidate.config(), "label": label, **_run_summary(point, result)})
                    on_run(f"{label} @ {_rate_text(rate)}: {point.throughput:.2f} req/s, "
                           f"{'met' if point.check.met else 'missed'} ({_values_text(point)})")
                    return point

                points, pruned = rate_search(measure, beat, steps=args.rate_steps, margin=args.margin)
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
