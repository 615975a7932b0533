"""A lone request against the machine's bandwidth ceiling (`bench compare`'s W1).

At one sequence a decode step reads every weight once, so tokens/s x weight bytes a token is the
read bandwidth the server turned into tokens; divided by the machine's measured read bandwidth it is
the share of the ceiling (issue 14 asks >= 60%). The reading is only as good as the bandwidth it is
held against, and a small cloud machine's moves by half within minutes (2-core AMD EPYC: 31 to 58
GB/s as neighbours come and go). So the request runs alone, repeat by repeat, with the bandwidth read
before the first and after each (best of five sums over 512 MB, the server idle), and each repeat is
held against the mean of the readings on either side of it; the median repeat is the figure. Two servers
up side by side take turns (`bench compare --paired`), so their ratio is measured within minutes, not
across a drift of the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics

import httpx
from tqdm.auto import tqdm

from llmaccel.bench import datasets
from llmaccel.bench.serve import run_benchmark
from llmaccel.bench.serve_metrics import RequestResult, compute_metrics, parse_goodput, parse_percentiles
from llmaccel.platform import read_bandwidth_gbps

_WEIGHTS = re.compile(r'^llmaccel_memory_bytes\{part="weights"\} (\S+)$', re.MULTILINE)


def lone_requests(benches: list[argparse.Namespace], prompt: datasets.SampleRequest, repeat: int, tokenizer,
                  progress: bool = True) -> list[dict]:
    """`repeat` lone requests on each server, as one `run_benchmark` summary per server, plus
    `read_bandwidth_gbps_beside` (the readings before and after each request) and `request_output_throughput`
    (each request's tokens / its latency). With several servers up side by side, each round runs one request
    on each in turn, the order reversed every other round (A B, B A, ...), so a machine whose bandwidth
    drifts weighs on all of them alike."""
    reading = read_bandwidth_gbps()
    runs: list[list[dict]] = [[] for _ in benches]
    beside: list[list[list[float]]] = [[] for _ in benches]
    label = " / ".join(bench.label for bench in benches)
    for round_ in tqdm(range(repeat), desc=f"bench {label} (lone requests)", disable=not progress):
        order = range(len(benches)) if round_ % 2 == 0 else reversed(range(len(benches)))
        for i in order:
            runs[i].append(asyncio.run(run_benchmark(benches[i], [prompt], tokenizer, float("inf"), 1,
                                                     progress=False)))
            after = read_bandwidth_gbps()
            beside[i].append([round(reading, 1), round(after, 1)])
            reading = after
    return [_summary(bench, server_runs, readings)
            for bench, server_runs, readings in zip(benches, runs, beside, strict=True)]


def _summary(bench: argparse.Namespace, runs: list[dict], beside: list[list[float]]) -> dict:
    results = [RequestResult(success=not run["errors"][0], prompt_len=run["input_lens"][0],
                             output_len=run["output_lens"][0], ttft=run["ttfts"][0], latency=run["e2els"][0],
                             itl=run["itls"][0], error=run["errors"][0]) for run in runs]
    summary = compute_metrics(results, sum(run["duration_s"] for run in runs), parse_percentiles(bench.percentiles),
                              parse_goodput(bench.goodput))
    merged = {**runs[0], **summary, "num_prompts": len(runs)}
    for key in ("input_lens", "output_lens", "ttfts", "e2els", "itls", "errors"):
        merged[key] = [value for run in runs for value in run[key]]
    merged["read_bandwidth_gbps_beside"] = beside
    merged["request_output_throughput"] = [r.output_len / r.latency if r.success and r.latency else None
                                           for r in results]
    return merged


def ceiling_share(single: dict, weight_bytes: int | None) -> dict | None:
    """The lone request's share of the bandwidth ceiling: the median over repeats (each against the mean
    of the readings either side of it), the lowest and highest, and the share against the best reading
    of the run (the strictest). None without weight bytes or a successful repeat."""
    beside, rates = single.get("read_bandwidth_gbps_beside") or [], single.get("request_output_throughput") or []
    if not weight_bytes or len(beside) != len(rates):
        return None
    shares = [rate * weight_bytes / (sum(readings) / 2 * 1e9) for readings, rate in zip(beside, rates, strict=True)
              if rate]
    if not shares:
        return None
    best = max(reading for readings in beside for reading in readings)
    return {"weight_bytes": weight_bytes, "median": statistics.median(shares), "lowest": min(shares),
            "highest": max(shares), "against_best_reading": single["output_throughput"] * weight_bytes / (best * 1e9)}


def served_weight_bytes(url: str) -> int | None:
    """The weight bytes an llmaccel server reports on /metrics, or None (another server, or none said)."""
    try:
        match = _WEIGHTS.search(httpx.get(url + "/metrics", timeout=10).text)
    except httpx.HTTPError:
        return None
    return int(float(match.group(1))) if match else None
