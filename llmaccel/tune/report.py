"""The tuner's output: the record of each configuration, the config file's header, the summary printed at the
end, and the frontier plot (each configuration's runs: arrival rate against how far from the SLO)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from llmaccel.tune.search import CandidateResult  # noqa: E402
from llmaccel.tune.slo import Objective  # noqa: E402


def result_record(result: CandidateResult) -> dict:
    return {"label": str(result.candidate), "config": result.candidate.config(), "goodput": result.goodput,
            "pruned": result.pruned, "runs": len(result.points)}


def closest_text(results: list[CandidateResult], objectives: tuple[Objective, ...]) -> str:
    """Where a search that met nothing came closest: the configuration, the rate, each value against its limit."""
    tried = [(r, r.closest) for r in results if r.closest is not None]
    if not tried:
        return "no run completed (see the server logs)"
    result, point = min(tried, key=lambda rp: rp[1].check.worst_ratio)
    limits = {f"{o.metric}_{o.stat}": o.limit_ms for o in objectives}
    values = ", ".join(f"{name} {value:.0f} ms against {limits[name]:g} ms"
                       for name, value in point.check.values_ms.items())
    rate = "all at once" if math.isinf(point.rate) else f"{point.rate:.2f} req/s"
    return (f"the closest run was {result.candidate} at {rate}: {values} ({point.check.worst_ratio:.2f}x the "
            "tightest limit); relax the SLO, shorten the requests or serve a smaller model")


def config_comment(args: argparse.Namespace, best: CandidateResult, defaults_goodput: float,
                   objectives: tuple[Objective, ...]) -> str:
    ratio = f"{best.goodput / defaults_goodput:.2f}x the defaults'" if defaults_goodput else "the defaults met none"
    return (f"written by llmaccel tune --slo \"{','.join(str(o) for o in objectives)}\" --dataset {args.dataset}\n"
            f"goodput {best.goodput:.2f} req/s at the SLO ({ratio}, {defaults_goodput:.2f} req/s); "
            f"{args.num_prompts} requests a run\n"
            "serve it with: llmaccel serve --config THIS_FILE")


def summary(record: dict) -> str:
    lines = [f"SLO {', '.join(record['slo'])}: {len(record['configurations'])} configurations, "
             f"{len(record['runs'])} runs",
             "| configuration | goodput (req/s) | runs |", "|---|---|---|"]
    for item in sorted(record["configurations"], key=lambda c: -c["goodput"]):
        pruned = " (pruned)" if item["pruned"] else ""
        lines.append(f"| {item['label']} | {item['goodput']:.2f} | {item['runs']}{pruned} |")
    lines.append(f"best: {record['best']} at {record['best_goodput']:.2f} req/s, "
                 f"{record['goodput_ratio']:.2f}x the defaults ({record['defaults_goodput']:.2f} req/s)")
    duel = record.get("head_to_head")
    if duel:
        lines.append(f"the defaults, fresh, at the winner's rate ({_rate_words(duel['rate'])}): "
                     f"{'met the SLO too (the ratio counts them equal)' if duel['met'] else 'missed the SLO'} "
                     f"({', '.join(f'{k} {v:.0f} ms' for k, v in duel['slo_values_ms'].items())})")
    verification = record.get("verification")
    if verification:
        rate = _rate_words(verification["rate"])
        lines.append(f"served again from its config file ({verification['command']}): "
                     f"{'met' if verification['met'] else 'MISSED'} the SLO at {rate} "
                     f"({', '.join(f'{k} {v:.0f} ms' for k, v in verification['slo_values_ms'].items())})")
    return "\n".join(lines)


def _rate_words(rate: float | str) -> str:
    return "all at once" if rate == "inf" else f"{rate:.2f} req/s"


def plot(results: list[CandidateResult], objectives: tuple[Objective, ...], path: Path) -> None:
    """Left: every paced run, arrival rate against the worst value/limit ratio (below 1 met), a line a configuration.
    Right: each configuration's goodput, the defaults and the winner marked."""
    fig, (runs_ax, bars_ax) = plt.subplots(1, 2, figsize=(12, 4.6), dpi=120)
    colors = plt.get_cmap("tab20").colors
    for index, result in enumerate(results):
        points = sorted((p for p in result.points if math.isfinite(p.rate)), key=lambda p: p.rate)
        if points:
            runs_ax.plot([p.rate for p in points], [p.check.worst_ratio for p in points], marker="o",
                         label=str(result.candidate), alpha=0.85, color=colors[index % len(colors)])
    runs_ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    runs_ax.set_yscale("log")
    runs_ax.set_xlabel("arrival rate (req/s)")
    runs_ax.set_ylabel("worst SLO value / limit (<= 1 met)")
    runs_ax.set_title(f"Runs against {', '.join(str(o) for o in objectives)}", fontsize=9)
    runs_ax.grid(alpha=0.3)
    runs_ax.legend(fontsize=6)
    ordered = sorted(results, key=lambda r: r.goodput)
    best = max(results, key=lambda r: r.goodput)
    colors = ["tab:green" if r is best and r.goodput > 0 else "tab:gray" if r is results[0] else "tab:blue"
              for r in ordered]
    bars_ax.barh([str(r.candidate) for r in ordered], [r.goodput for r in ordered], color=colors)
    bars_ax.set_xlabel("goodput at the SLO (req/s)")
    bars_ax.set_title("Goodput per configuration (gray: defaults, green: best)", fontsize=9)
    bars_ax.tick_params(axis="y", labelsize=7)
    bars_ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
