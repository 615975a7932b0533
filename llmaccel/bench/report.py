"""Tables and plots from benchmark result files (`--result-json`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from llmaccel.platform import machine_record


def write_result(path: Path, args: argparse.Namespace, **figures: object) -> None:
    """A benchmark's result file: the machine it ran on, its arguments, then its figures."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine_record(), "args": {
        k: str(v) for k, v in vars(args).items() if k != "func"}, **figures}, indent=1) + "\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", nargs="+", type=Path, help="result JSON files written by `bench offline`")
    parser.add_argument("--out", type=Path, default=Path("docs/img/offline.png"), help="PNG file to write")


def _label(data: dict) -> str:
    args = data["args"]
    first = data["results"][0]
    prompts = f"{first['num_prompts']} prompt{'s' if first['num_prompts'] != 1 else ''}"
    if args.get("output_len") not in (None, "None"):
        return f"{prompts} x {args['output_len']} tokens"
    return f"{prompts}, built-in lengths"


def markdown_table(files: list[Path]) -> str:
    lines = ["| workload | system | wall s | output tok/s | vs HF one-at-a-time | vs HF static batch | peak RSS |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for file in files:
        data = json.loads(file.read_text())
        by_system = {r["system"]: r for r in data["results"]}
        seq, static = by_system.get("hf-sequential"), by_system.get("hf-static-batch")
        for r in data["results"]:
            vs_seq = f"{r['output_tokens_per_s'] / seq['output_tokens_per_s']:.2f}x" if seq else "-"
            vs_static = f"{r['output_tokens_per_s'] / static['output_tokens_per_s']:.2f}x" if static else "-"
            lines.append(f"| {_label(data)} | {r['system']} | {r['wall_s']:.1f} | {r['output_tokens_per_s']:.1f} | "
                         f"{vs_seq} | {vs_static} | {r['peak_rss_bytes'] / 2**20:.0f} MiB |")
    return "\n".join(lines)


def plot(files: list[Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = ["hf-sequential", "hf-static-batch", "llmaccel"]
    colors = {"hf-sequential": "#9e9e9e", "hf-static-batch": "#5c7cfa", "llmaccel": "#e8590c"}
    datasets = [json.loads(f.read_text()) for f in files]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.26
    for i, data in enumerate(datasets):
        by_system = {r["system"]: r for r in data["results"]}
        for j, system in enumerate(systems):
            if system not in by_system:
                continue
            value = by_system[system]["output_tokens_per_s"]
            x = i + (j - 1) * width
            ax.bar(x, value, width, color=colors[system], label=system if i == 0 or system not in
                   {r["system"] for d in datasets[:i] for r in d["results"]} else None)
            ax.text(x, value, f"{value:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(datasets)), [_label(d) for d in datasets])
    ax.set_ylabel("output tokens / s (higher is better)")
    ax.set_title("llmaccel vs HF transformers, same machine, same run (float32, 2-core CPU)")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys())
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def run(args: argparse.Namespace) -> int:
    plot(args.results, args.out)
    print(markdown_table(args.results))
    print(f"\nwrote {args.out}")
    return 0
