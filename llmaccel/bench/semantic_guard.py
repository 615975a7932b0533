"""The semantic input guard's rows of `llmaccel bench safety`: held-out detection, the trade-off over the
threshold, and the latency of a separate pass.

Detection: every labelled set scored by a classifier of the shipped one's kind (its layers, pooling and
penalty) trained on the other sets only (safety/guard_train.py), at the shipped threshold: the rules
alone, the semantic stage alone, and both. The curve: recall against false positives at every threshold.
Latency: the separate pass (the model up to the classifier's last layer, over the prompt) against the
whole prefill of the same prompt, by prompt length; and the verdict itself (one dot product).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from llmaccel.bench.serve_metrics import percentile


def evaluate(model: str, guard: str, rule_check, lengths: list[int], samples: int) -> dict:
    from llmaccel.config import EngineConfig
    from llmaccel.engine.engine import LLMEngine
    from llmaccel.safety.guard_train import ALL_SETS, choose_threshold, evaluation, extract, held_out_scores
    from llmaccel.safety.semantic_guard import GuardClassifier, render_prompt, resolve_guard

    path = resolve_guard(guard, model)
    if path is None:
        raise ValueError(f"no semantic guard classifier for {model}; train one with llmaccel safety train-guard "
                         f"--model {model}, or pass --semantic-guard off")
    classifier = GuardClassifier.load(path)
    engine = LLMEngine(EngineConfig.create(model, semantic_guard=None))
    spec = engine.spec
    classifier.check_model(path, model, spec.architecture, spec.hidden_size, spec.num_layers)
    sets = extract(engine, model, classifier.layers, ALL_SETS)
    hits = {s.name: [rule_check(t).blocked_by is not None for t in s.texts] for s in sets}
    scores = held_out_scores(sets, classifier.pooling)
    report = evaluation(sets, scores, hits, classifier.threshold)
    report["at_1_percent"] = evaluation(sets, scores, hits, choose_threshold(sets, scores, hits, 0.01))["totals"]
    report["curve"] = tradeoff(sets, scores, hits)
    texts = [t for s in sets for t in s.texts]
    report["latency"] = pass_latency(engine, classifier, [render_prompt(engine.tokenizer, t) for t in texts[::7]],
                                     lengths, samples)
    report["classifier"] = {"file": str(path), "layers": list(classifier.layers), "pooling": classifier.pooling,
                            "threshold": classifier.threshold}
    return report


def tradeoff(sets, scores: dict[str, torch.Tensor], hits: dict[str, list[bool]]) -> list[dict]:
    """(threshold, false positives and recall of the semantic stage alone and of both) at 200 thresholds; recall
    over the trained attack sets (the evaluation-only ones are an unseen family, reported per set)."""
    from llmaccel.safety.guard_train import EVALUATION_ONLY

    attack = [(h, v) for s in sets if s.is_attack and s.name not in EVALUATION_ONLY
              for h, v in zip(hits[s.name], scores[s.name].tolist(), strict=True)]
    benign = [(h, v) for s in sets if not s.is_attack for h, v in zip(hits[s.name], scores[s.name].tolist(),
                                                                       strict=True)]
    every = sorted({v for _, v in attack + benign})
    points = []
    for threshold in [every[int(i * (len(every) - 1) / 199)] for i in range(200)]:
        points.append({"threshold": threshold,
                       "fp_semantic": sum(v >= threshold for _, v in benign) / len(benign),
                       "recall_semantic": sum(v >= threshold for _, v in attack) / len(attack),
                       "fp_both": sum(h or v >= threshold for h, v in benign) / len(benign),
                       "recall_both": sum(h or v >= threshold for h, v in attack) / len(attack)})
    return points


def pass_latency(engine, classifier, prompts: list[list[int]], lengths: list[int], samples: int) -> list[dict]:
    """Per prompt length (tokens): the separate pass and the whole prefill, p50/p99 ms; the verdict in us."""
    pool = [ids for ids in prompts if len(ids) >= 8]
    rows = []
    for length in lengths:
        chosen = []
        for i in range(samples):  # prompts continued with the next ones up to the length
            ids, j = [], i
            while len(ids) < length:
                ids += pool[j % len(pool)]
                j += 1
            chosen.append(ids[:length])
        separate, whole = [], []
        engine.scorer.pooled_states(chosen[0], classifier.layers)  # warm-up
        for ids in chosen:
            start = time.perf_counter()
            mean, last = engine.scorer.pooled_states(ids, classifier.layers)
            separate.append((time.perf_counter() - start) * 1e3)
            start = time.perf_counter()
            engine.scorer.hidden_states(ids)
            whole.append((time.perf_counter() - start) * 1e3)
        features = classifier.features(mean, last)
        start = time.perf_counter()
        for _ in range(100):
            classifier.score(features)
        verdict_us = (time.perf_counter() - start) * 1e4
        separate.sort()
        whole.sort()
        rows.append({"tokens": length, "samples": samples, "separate_p50_ms": percentile(separate, 50),
                     "separate_p99_ms": percentile(separate, 99), "prefill_p50_ms": percentile(whole, 50),
                     "prefill_p99_ms": percentile(whole, 99), "verdict_us": verdict_us,
                     "separate_over_prefill": statistics.median(separate) / statistics.median(whole)})
    return rows


def format_rows(report: dict) -> str:
    from llmaccel.safety.guard_train import EVALUATION_ONLY

    lines = ["| set | prompts | rules | semantic (held out) | both |", "|---|---|---|---|---|"]
    for row in report["sets"]:
        kind = ("unseen" if row["set"] in EVALUATION_ONLY else "jailbreak") if row["attack"] else "ordinary"
        lines.append(f"| {kind}: {row['set']} | {row['prompts']} | {row['rules']:.1%} | {row['semantic']:.1%} | "
                     f"{row['both']:.1%} |")
    totals = report["totals"]
    lines += ["", f"threshold {totals['threshold']:.4f} (the shipped classifier's):"]
    for key, label in (("recall", "recall, every jailbreak set"), ("recall_other", "recall, the sets the rules "
                       "were not written on"), ("false_positives", "false positives, every ordinary set")):
        lines.append(f"- {label}: rules {totals[key + '_rules']:.1%}, semantic {totals[key + '_semantic']:.1%}, "
                     f"both {totals[key + '_both']:.1%}")
    lines += ["", "| prompt tokens | separate pass p50 / p99 ms | whole prefill p50 / p99 ms | pass / prefill | "
              "verdict us |", "|---|---|---|---|---|"]
    for r in report["latency"]:
        lines.append(f"| {r['tokens']} | {r['separate_p50_ms']:.1f} / {r['separate_p99_ms']:.1f} | "
                     f"{r['prefill_p50_ms']:.1f} / {r['prefill_p99_ms']:.1f} | {r['separate_over_prefill']:.2f} | "
                     f"{r['verdict_us']:.1f} |")
    return "\n".join(lines)


def plot_tradeoff(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = report["curve"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p["fp_semantic"] * 100 for p in curve], [p["recall_semantic"] * 100 for p in curve],
            label="semantic stage alone")
    ax.plot([p["fp_both"] * 100 for p in curve], [p["recall_both"] * 100 for p in curve], label="rules + semantic")
    totals = report["totals"]
    ax.scatter([totals["false_positives_rules"] * 100], [totals["recall_rules"] * 100], color="black", zorder=3,
               label="rules alone")
    ax.scatter([totals["false_positives_both"] * 100], [totals["recall_both"] * 100], color="red", zorder=3,
               label=f"shipped threshold {totals['threshold']:.3f}")
    ax.axvline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlim(0, 100)
    ax.set_xlabel("false positives on ordinary prompts (%, held-out scores)")
    ax.set_ylabel("jailbreaks blocked (%)")
    ax.set_title("Semantic input guard over its threshold (held out by set)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
