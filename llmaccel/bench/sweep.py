"""`llmaccel bench sweep` (one `bench serve` run per concurrency or request rate) and
`llmaccel bench plot` (a markdown table and PNG plots from result files, one line per server label).

    llmaccel bench sweep --base-url http://127.0.0.1:8000 --concurrency 1,4,16,64 --result-dir results
    llmaccel bench plot results/*.json --out-dir docs/img
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from llmaccel.bench import serve  # noqa: E402


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    serve.add_arguments(parser, sweep=True)
    points = parser.add_mutually_exclusive_group(required=True)
    points.add_argument("--concurrency", help="comma list of max concurrencies, e.g. 1,4,16,64 (all sent at once)")
    points.add_argument("--request-rates", help="comma list of request rates (req/s), e.g. 1,2,4,8")
    parser.add_argument("--min-prompts-per-concurrency", type=int, default=2,
                        help="each concurrency point sends at least this many x its concurrency prompts")
    parser.add_argument("--result-dir", type=Path, default=Path("results"), help="where result JSON files go")
    parser.add_argument("--plot-dir", type=Path, help="where the PNGs go (default: --result-dir)")


def add_plot_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", nargs="+", type=Path, help="result JSON files of bench serve / bench sweep")
    parser.add_argument("--out-dir", type=Path, default=Path("."), help="where the PNGs go")
    parser.add_argument("--prefix", default="serve", help="file name prefix of the PNGs")


def run_sweep(args: argparse.Namespace) -> int:
    tokenizer = serve.tokenizer_for(args)
    by_concurrency = args.concurrency is not None
    values = [float(v) for v in (args.concurrency or args.request_rates).split(",") if v.strip()]
    if not values or any(v <= 0 for v in values):
        raise ValueError("the sweep points must be positive numbers")
    args.result_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for value in values:
        count = max(args.num_prompts, int(value) * args.min_prompts_per_concurrency if by_concurrency else 0)
        requests = serve.sample_requests(argparse.Namespace(**{**vars(args), "num_prompts": count}), tokenizer)
        rate, cap = (float("inf"), int(value)) if by_concurrency else (value, None)
        result = asyncio.run(serve.run_benchmark(args, requests, tokenizer, rate, cap))
        point = f"c{int(value)}" if by_concurrency else f"r{value:g}"
        path = args.result_dir / f"{_slug(result['label'])}-{point}.json"
        path.write_text(json.dumps(result, indent=1))
        files.append(path)
        print(f"{point}: {result['request_throughput']:.2f} req/s, {result['output_throughput']:.1f} tok/s, "
              f"p50 TTFT {result['median_ttft_ms']:.0f} ms, p50 TPOT {result['median_tpot_ms']:.1f} ms, "
              f"{result['failed']} failed -> {path}", file=sys.stderr)
    print(plot_results([json.loads(f.read_text()) for f in files], args.plot_dir or args.result_dir))
    return 0


def run_plot(args: argparse.Namespace) -> int:
    results = []
    for path in args.results:
        try:
            results.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: cannot read a result file ({exc})") from None
        if "output_throughput" not in results[-1]:
            raise ValueError(f"{path}: not a bench serve result (no output_throughput)")
    print(plot_results(results, args.out_dir, args.prefix))
    return 0


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text)


def _x(result: dict) -> float:
    return result["max_concurrency"] if result.get("max_concurrency") else result["request_rate"]


def plot_results(results: list[dict], out_dir: Path, prefix: str = "serve") -> str:
    """Write `<prefix>-throughput.png` and `<prefix>-latency.png`; return a markdown table."""
    out_dir.mkdir(parents=True, exist_ok=True)
    series: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        series[r["label"]].append(r)
    for points in series.values():
        points.sort(key=_x)
    by_concurrency = all(r.get("max_concurrency") for r in results)
    x_name = "max concurrency" if by_concurrency else "request rate (req/s)"

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for label, points in series.items():
        ax.plot([_x(p) for p in points], [p["output_throughput"] for p in points], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({_x(r) for r in results}))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel(x_name)
    ax.set_ylabel("output tokens/s")
    ax.set_title("Output throughput")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / f"{prefix}-throughput.png")
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    for ax, metric, title in ((axes[0], "ttft", "Time to first token"), (axes[1], "tpot", "Time per output token")):
        for label, points in series.items():
            xs = [p["output_throughput"] for p in points]
            line = ax.plot(xs, [p[f"median_{metric}_ms"] for p in points], marker="o", label=f"{label} p50")[0]
            p99 = [p.get(f"p99_{metric}_ms", float("nan")) for p in points]
            ax.plot(xs, p99, marker="^", linestyle="--", color=line.get_color(), label=f"{label} p99")
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{metric.upper()} (ms)")
        ax.set_yscale("log")
        ax.set_title(f"{title} vs throughput")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / f"{prefix}-latency.png")
    plt.close(fig)
    return markdown_table(results, x_name)


def markdown_table(results: list[dict], x_name: str) -> str:
    head = (f"| server | {x_name} | req/s | output tok/s | p50 TTFT (ms) | p99 TTFT (ms) | p50 TPOT (ms) | "
            "p99 TPOT (ms) | p99 ITL (ms) | mean E2EL (s) | failed |")
    lines = [head, "|---" * 11 + "|"]
    for r in sorted(results, key=lambda r: (r["label"], _x(r))):
        lines.append(f"| {r['label']} | {_x(r):g} | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} | "
                     f"{r['median_ttft_ms']:.0f} | {r.get('p99_ttft_ms', float('nan')):.0f} | "
                     f"{r['median_tpot_ms']:.1f} | {r.get('p99_tpot_ms', float('nan')):.1f} | "
                     f"{r.get('p99_itl_ms', float('nan')):.1f} | {r['mean_e2el_ms'] / 1000:.2f} | {r['failed']} |")
    return "\n".join(lines)
