"""`llmaccel bench safety`: how fast the input filter is, and how well it separates jailbreaks from
ordinary requests, on labelled prompt sets from PyPI wheels (llmaccel/safety/prompt_sets.py).

Latency: prompts cut or padded to each length (ordinary requests and jailbreaks, half each), every
check timed alone, after a warm-up; percentiles per length. Detection: the share of each jailbreak
set the filter blocks (recall) and of each ordinary set it blocks (false positives). The default
rules were written against the even-numbered half of `inthewild`, so its odd half is reported on its
own as held-out data. With a semantic guard (`--semantic-guard`, on by default): its held-out rows, the
trade-off curve over its threshold and the latency of a separate pass (bench/semantic_guard.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

from llmaccel.bench.serve_metrics import percentile

DEFAULT_LENGTHS = "100,500,1000,2000,4000,8000"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from llmaccel.safety.prompt_sets import BENIGN_SETS, JAILBREAK_SETS

    parser.add_argument("--safety-rules", action="append", metavar="F",
                        help="rule files to measure (repeatable; 'default' is the shipped set, used when none given)")
    parser.add_argument("--lengths", default=DEFAULT_LENGTHS, help="prompt lengths in characters for the latency "
                                                                   "table, comma-separated")
    parser.add_argument("--samples", type=int, default=400, help="prompts timed per length")
    parser.add_argument("--jailbreak-sets", default=",".join(JAILBREAK_SETS), help="sets that should be blocked")
    parser.add_argument("--benign-sets", default=",".join(BENIGN_SETS), help="sets that should pass")
    parser.add_argument("--show", type=int, default=0, metavar="N",
                        help="print up to N missed jailbreaks and N false positives, for rule writing")
    parser.add_argument("--result-json", type=Path, help="write every figure to this JSON file")
    parser.add_argument("--plot", type=Path, metavar="F.png", help="plot latency percentiles against prompt length")
    parser.add_argument("--semantic-guard", default="default", metavar="F",
                        help="also measure the semantic input guard: a classifier file, 'default' (the one for "
                             "--model) or 'off'. Its rows use every labelled set, each scored held out")
    parser.add_argument("--model", default="smollm2-135m", help="the model whose hidden states the guard reads")
    parser.add_argument("--guard-lengths", default="64,256,1024,2048",
                        help="prompt lengths in tokens for the separate pass's latency, comma-separated")
    parser.add_argument("--guard-samples", type=int, default=30, help="prompts timed per length")
    parser.add_argument("--guard-plot", type=Path, metavar="F.png",
                        help="plot recall against false positives over the semantic guard's threshold")


def fit_length(texts: list[str], length: int, count: int) -> list[str]:
    """`count` texts of exactly `length` characters: each text, continued with the next ones if short."""
    out = []
    for i in range(count):
        pieces, size, j = [], 0, i
        while size < length:
            pieces.append(texts[j % len(texts)])
            size += len(pieces[-1]) + 1
            j += 1
        out.append(" ".join(pieces)[:length])
    return out


def measure_latency(check, benign: list[str], jailbreaks: list[str], lengths: list[int], samples: int) -> list[dict]:
    rows = []
    for length in lengths:
        texts = fit_length(benign, length, samples // 2) + fit_length(jailbreaks, length, samples - samples // 2)
        for text in texts[:20]:  # warm-up
            check(text)
        times = []
        for text in texts:
            start = time.perf_counter()
            check(text)
            times.append((time.perf_counter() - start) * 1e3)
        times.sort()
        rows.append({"chars": length, "samples": len(times), "p50_ms": percentile(times, 50),
                     "p90_ms": percentile(times, 90), "p99_ms": percentile(times, 99), "max_ms": times[-1],
                     "mean_ms": statistics.fmean(times)})
    return rows


def measure_detection(check, sets: dict[str, list[str]], should_block: bool, show: int) -> list[dict]:
    rows = []
    for name, prompts in sets.items():
        rules: Counter[str] = Counter()
        wrong = []
        for prompt in prompts:
            blocked = check(prompt).blocked_by
            if blocked is not None:
                rules[blocked.rule.id] += 1
            if (blocked is not None) != should_block:
                wrong.append((prompt, blocked))
        blocked_count = sum(rules.values())
        rows.append({"set": name, "prompts": len(prompts), "blocked": blocked_count,
                     "rate": blocked_count / len(prompts), "by_rule": dict(rules.most_common())})
        for prompt, blocked in wrong[:show]:
            label = blocked.describe() if blocked is not None else "missed"
            print(f"  {name}: {label}: {prompt[:160]!r}", file=sys.stderr)
    return rows


def _sets(names: str, loaders: dict) -> dict[str, list[str]]:
    from llmaccel.safety.prompt_sets import load_prompt_set

    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in loaders]
    if unknown:
        raise ValueError(f"unknown prompt set(s) {', '.join(unknown)}; choose from {', '.join(loaders)}")
    sets = {}
    for name in chosen:
        prompts = load_prompt_set(name)
        if name == "inthewild":  # the default rules were written on the even half
            sets["inthewild (even half: rules written on it)"] = prompts[0::2]
            sets["inthewild (odd half: held out)"] = prompts[1::2]
        sets[name] = prompts
    return sets


def format_report(latency: list[dict], jailbreak: list[dict], benign: list[dict]) -> str:
    lines = ["| prompt chars | p50 ms | p90 ms | p99 ms | max ms |", "|---|---|---|---|---|"]
    lines += [f"| {r['chars']:,} | {r['p50_ms']:.3f} | {r['p90_ms']:.3f} | {r['p99_ms']:.3f} | {r['max_ms']:.3f} |"
              for r in latency]
    lines += ["", "| set | prompts | blocked | rate |", "|---|---|---|---|"]
    for kind, rows in (("jailbreak", jailbreak), ("ordinary", benign)):
        lines += [f"| {kind}: {r['set']} | {r['prompts']} | {r['blocked']} | {r['rate'] * 100:.1f}% |" for r in rows]
    lines.append("")
    for kind, rows in (("jailbreaks", jailbreak), ("ordinary requests", benign)):
        whole = [r for r in rows if "half" not in r["set"]]
        total, blocked = sum(r["prompts"] for r in whole), sum(r["blocked"] for r in whole)
        lines.append(f"all {kind}: {blocked}/{total} blocked = {blocked / max(total, 1) * 100:.1f}%")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from llmaccel.safety.input_filter import InputFilter
    from llmaccel.safety.prompt_sets import BENIGN_SETS, JAILBREAK_SETS
    from llmaccel.safety.rules import load_rules

    sources = args.safety_rules or ["default"]
    check = InputFilter(load_rules(sources)).check
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    if not lengths or min(lengths) < 1 or args.samples < 2:
        raise ValueError("--lengths needs positive lengths and --samples at least 2")
    jailbreak_sets, benign_sets = _sets(args.jailbreak_sets, JAILBREAK_SETS), _sets(args.benign_sets, BENIGN_SETS)
    all_benign = [p for name, ps in benign_sets.items() for p in ps]
    all_jailbreaks = [p for name, ps in jailbreak_sets.items() if "half" not in name for p in ps]
    latency = measure_latency(check, all_benign, all_jailbreaks, lengths, args.samples)
    jailbreak = measure_detection(check, jailbreak_sets, True, args.show)
    benign = measure_detection(check, benign_sets, False, args.show)
    print(f"input filter, rules: {', '.join(sources)}")
    print(format_report(latency, jailbreak, benign))
    semantic = None
    if args.semantic_guard != "off":
        from llmaccel.bench import semantic_guard

        guard_lengths = [int(x) for x in args.guard_lengths.split(",") if x.strip()]
        semantic = semantic_guard.evaluate(args.model, args.semantic_guard, check, guard_lengths, args.guard_samples)
        print(f"\nsemantic guard: {semantic['classifier']['file']} on {args.model}")
        print(semantic_guard.format_rows(semantic))
        if args.guard_plot:
            semantic_guard.plot_tradeoff(semantic, args.guard_plot)
    if args.result_json:
        from llmaccel.platform import describe

        args.result_json.write_text(json.dumps({"machine": describe(), "rules": sources, "latency": latency,
                                                "jailbreak": jailbreak, "benign": benign, "semantic_guard": semantic},
                                               indent=2) + "\n")
    if args.plot:
        plot_latency(latency, args.plot)
    return 0


def plot_latency(latency: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chars = [r["chars"] for r in latency]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, label in (("p50_ms", "p50"), ("p99_ms", "p99"), ("max_ms", "max")):
        ax.plot(chars, [r[key] for r in latency], marker="o", label=label)
    ax.axhline(2.0, color="grey", linestyle="--", linewidth=1, label="2 ms target (4,000 chars)")
    ax.set_xlabel("prompt length (characters)")
    ax.set_ylabel("filter time per prompt (ms)")
    ax.set_title("llmaccel input filter latency (default rules)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
