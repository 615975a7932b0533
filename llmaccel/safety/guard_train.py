"""Training and honest evaluation of the semantic input guard (`llmaccel safety train-guard`).

Features: every prompt of the labelled sets (safety/prompt_sets.py) as a one-message chat, rendered by
the model's chat template as the server renders it, through a pass of the served model that stops
after the deepest pooled layer (engine/scoring.py `pooled_states`); cached per model, layer and set.

Evaluation asks the question of the next attack: how much of a family the classifier never saw does it
catch, at how many ordinary prompts blocked?
- Each attack set is held out whole: scored by a classifier trained on every other set. Sets share
  templates (GPTFuzzer's seeds are jailbreakchat prompts that the in-the-wild set also collected), so a
  training prompt that nearly duplicates a held-out prompt (word 5-gram Jaccard > 0.5) leaves that fold too.
- Ordinary prompts are scored by 5-fold cross-validation over all ordinary sets together: each by a
  classifier that never saw it. Holding ordinary sets out whole as well is the stricter figure, reported
  beside it (`false_positives_sets_held_out`): a new application's ordinary prompts may be unlike all of ours.
- Sets in EVALUATION_ONLY are never trained on, in any fold or in the shipped file.
The threshold is the lowest at which the rules and the classifier together block at most the target
share of ordinary prompts; the shipped classifier is then fit on every set.

Each set weighs 1/sqrt(its size) within its class, so that 666 in-the-wild prompts do not drown
45 hermes templates: the classifier learns what attack families share, not the largest family
(docs/safety.md has the measurements that chose this, the layer and the penalty).
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from llmaccel.safety.prompt_sets import BENIGN_SETS, JAILBREAK_SETS, load_prompt_set
from llmaccel.safety.semantic_guard import GuardClassifier, render_prompt

logger = logging.getLogger(__name__)

MAX_PROMPT_CHARS = 8000  # longer prompts are cut before rendering: training time, not a serving limit
NEAR_DUPLICATE = 0.5
# sets no classifier is trained on, in any fold or in the shipped file: scored as an unseen family only
# (libertas is AGPL-3.0 text: measured against, not learned from)
EVALUATION_ONLY = frozenset({"libertas"})


@dataclass(frozen=True)
class LabelledFeatures:
    name: str
    is_attack: bool
    texts: list[str]
    mean: torch.Tensor  # [prompts, layers * hidden] float32
    last: torch.Tensor


def extract(engine, model: str, layers: tuple[int, ...], names: list[str], cache_dir: Path | None = None,
            progress: bool = True, limit: int | None = None) -> list[LabelledFeatures]:
    """The pooled features of every prompt of the named sets on `engine`'s model (cached on disk); with
    `limit`, of at most that many prompts of each set, a seeded sample (a cost run on a large model)."""
    from tqdm import tqdm

    from llmaccel.config import default_cache_dir

    root = (cache_dir or default_cache_dir()) / "guard-features"
    key = hashlib.sha256(f"{model}|{engine.config.model.dtype}|{layers}".encode()).hexdigest()[:16]
    out = []
    for name in names:
        texts = load_prompt_set(name, cache_dir)
        if limit is not None and len(texts) > limit:
            import random

            texts = [texts[i] for i in sorted(random.Random(0).sample(range(len(texts)), limit))]
        suffix = f"-n{limit}" if limit is not None else ""
        target = root / f"{re.sub(r'[^A-Za-z0-9._-]+', '_', model)}-{key}-{name}{suffix}.pt"
        digest = hashlib.sha256("\x00".join(texts).encode()).hexdigest()
        stored = torch.load(target) if target.is_file() else None
        if stored is None or stored["digest"] != digest:
            means, lasts = [], []
            for text in tqdm(texts, desc=f"features: {name}", disable=not progress, unit="prompt"):
                ids = render_prompt(engine.tokenizer, text[:MAX_PROMPT_CHARS])[:engine.max_model_len]
                mean, last = engine.scorer.pooled_states(ids, layers)
                means.append(mean)
                lasts.append(last)
            stored = {"digest": digest, "mean": torch.stack(means), "last": torch.stack(lasts)}
            target.parent.mkdir(parents=True, exist_ok=True)
            torch.save(stored, target)
        out.append(LabelledFeatures(name, name in JAILBREAK_SETS, texts, stored["mean"], stored["last"]))
    return out


# ---- the classifier -------------------------------------------------------------------------------

def fit_logistic(x: torch.Tensor, y: torch.Tensor, l2: float = 1e-2, steps: int = 200,
                 sample_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """(mean, scale, weight, bias) of an L2-regularized logistic regression on standardized features,
    each class weighted to half the loss (the sets are unbalanced; within a class by `sample_weight`),
    fit by L-BFGS."""
    x = x.double()
    mean, scale = x.mean(0), x.std(0).clamp_min(1e-6)
    z = (x - mean) / scale
    target = y.double()
    within = torch.ones_like(target) if sample_weight is None else sample_weight.double()
    weights = torch.where(target > 0, 0.5 * within / (within * target).sum(),
                          0.5 * within / (within * (1 - target)).sum())
    w = torch.zeros(z.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([w, b], max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = (weights * torch.nn.functional.binary_cross_entropy_with_logits(z @ w + b, target, reduction="none")
                ).sum() + 0.5 * l2 * (w * w).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    return mean.float(), scale.float(), w.detach().float(), float(b.detach())


def _shingles(text: str) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i:i + 5]) for i in range(max(1, len(words) - 4))}


def near_duplicates(sets: list[LabelledFeatures]) -> dict[str, set[tuple[str, int]]]:
    """For each set: the (set, index) prompts of the other sets that nearly duplicate one of its own."""
    shingles = {s.name: [_shingles(t) for t in s.texts] for s in sets}
    out: dict[str, set[tuple[str, int]]] = {s.name: set() for s in sets}
    names = [s.name for s in sets]
    for a_index, a in enumerate(names):
        for b in names[a_index + 1:]:
            for i, x in enumerate(shingles[a]):
                for j, y in enumerate(shingles[b]):
                    if x and y and len(x & y) > NEAR_DUPLICATE * len(x | y):
                        out[a].add((b, j))
                        out[b].add((a, i))
    return out


def _training_data(sets: list[LabelledFeatures], pooling: str, keep) -> tuple[torch.Tensor, ...]:
    """(features, labels, weights) of the prompts `keep(set, index)` admits, each set weighing 1/sqrt(size)."""
    xs, ys, ws = [], [], []
    for s in sets:
        if s.name in EVALUATION_ONLY:
            continue
        chosen = [i for i in range(len(s.texts)) if keep(s, i)]
        if chosen:
            xs.append(_features(s, pooling)[chosen])
            ys.append(torch.full((len(chosen),), float(s.is_attack)))
            ws.append(torch.full((len(chosen),), len(chosen) ** -0.5))
    return torch.cat(xs), torch.cat(ys), torch.cat(ws)


def _scorer(sets, pooling: str, l2: float, keep):
    x, y, weights = _training_data(sets, pooling, keep)
    mean, scale, weight, bias = fit_logistic(x, y, l2, sample_weight=weights)
    return lambda features: torch.sigmoid(((features - mean) / scale) @ weight + bias)


ORDINARY_FOLDS = 5


def held_out_scores(sets: list[LabelledFeatures], pooling: str, l2: float = 1e-2, ordinary: str = "folds",
                    seed: int = 0, duplicates: dict[str, set[tuple[str, int]]] | None = None
                    ) -> dict[str, torch.Tensor]:
    """Every prompt's score from a classifier that never saw it (the module docstring): each attack set from
    one trained without it and its near duplicates; the ordinary prompts by ORDINARY_FOLDS-fold cross-
    validation (`ordinary="folds"`) or, stricter, each ordinary set held out whole (`ordinary="sets"`).
    `duplicates`: near_duplicates(sets), when the caller already has it (it compares every pair of prompts)."""
    import random

    duplicates = near_duplicates(sets) if duplicates is None else duplicates
    rng = random.Random(seed)
    fold = {(s.name, i): rng.randrange(ORDINARY_FOLDS) for s in sets if not s.is_attack for i in range(len(s.texts))}
    out: dict[str, torch.Tensor] = {}
    for held in sets:
        if held.is_attack or ordinary == "sets":
            score = _scorer(sets, pooling, l2, lambda s, i, held=held: s.name != held.name
                            and (s.name, i) not in duplicates[held.name])
            out[held.name] = score(_features(held, pooling))
    if ordinary == "folds":
        for k in range(ORDINARY_FOLDS):
            score = _scorer(sets, pooling, l2, lambda s, i, k=k: s.is_attack or fold[(s.name, i)] != k)
            for s in sets:
                if not s.is_attack:
                    rows = [i for i in range(len(s.texts)) if fold[(s.name, i)] == k]
                    out.setdefault(s.name, torch.zeros(len(s.texts)))[rows] = score(_features(s, pooling)[rows])
    return out


def _features(s: LabelledFeatures, pooling: str) -> torch.Tensor:
    return torch.cat([s.mean, s.last], dim=-1) if pooling == "mean+last" else s.mean


def choose_threshold(sets: list[LabelledFeatures], scores: dict[str, torch.Tensor],
                     rule_hits: dict[str, list[bool]], max_false_positives: float) -> float:
    """The lowest threshold at which rules + semantic stage block at most `max_false_positives` of the
    ordinary prompts (held-out scores)."""
    benign = [s for s in sets if not s.is_attack]
    total = sum(len(s.texts) for s in benign)
    candidates = sorted({float(v) for s in benign for v in scores[s.name]} | {0.5}, reverse=True)
    best = 0.999
    for threshold in candidates:
        blocked = sum(int(hit or score >= threshold) for s in benign
                      for hit, score in zip(rule_hits[s.name], scores[s.name].tolist(), strict=True))
        if blocked > max_false_positives * total:
            break
        best = threshold
    return min(max(best, 1e-4), 0.9999)


def train_classifier(sets: list[LabelledFeatures], model: str, architecture: str, hidden_size: int,
                     num_layers: int, layers: tuple[int, ...], pooling: str, threshold: float,
                     probe: torch.Tensor, l2: float = 1e-2) -> GuardClassifier:
    x, y, weights = _training_data(sets, pooling, lambda s, i: True)
    mean, scale, weight, bias = fit_logistic(x, y, l2, sample_weight=weights)
    sets = [s for s in sets if s.name not in EVALUATION_ONLY]
    return GuardClassifier(model=model, architecture=architecture, hidden_size=hidden_size, num_layers=num_layers,
                           layers=layers, pooling=pooling, mean=mean, scale=scale, weight=weight, bias=bias,
                           threshold=threshold, probe=probe, sources=tuple(s.name for s in sets))


ALL_SETS = [*JAILBREAK_SETS, *BENIGN_SETS]


# ---- llmaccel safety train-guard -----------------------------------------------------------------

DEFAULT_LAYERS = (16,)  # chosen by held-out scans of single layers and triples (docs/safety.md)


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="the model to train the classifier for: an alias, "
                        "an HF directory or a hub id in the local cache (its hidden states are the features)")
    parser.add_argument("--output", type=Path, help="the classifier file to write (default: the cache directory's "
                        "guards/, where `serve --semantic-guard default` looks for this model's)")
    parser.add_argument("--layers", default=",".join(map(str, DEFAULT_LAYERS)),
                        help="0-based layers whose output stream is pooled, comma-separated (the pass stops after "
                             "the last)")
    parser.add_argument("--pooling", choices=("mean", "mean+last"), default="mean",
                        help="mean over every prompt token, or that and the last token's stream side by side")
    parser.add_argument("--max-false-positives", type=float, default=0.01,
                        help="the threshold is the lowest at which rules + classifier block at most this fraction "
                             "of the ordinary prompts, on scores from classifiers that never saw their set")
    parser.add_argument("--l2", type=float, default=1e-2, help="L2 penalty of the logistic regression")
    parser.add_argument("--ordinary-held-out", choices=("folds", "sets"), default="folds",
                        help="how ordinary prompts are scored for the threshold: 5-fold cross-validation over all "
                             "ordinary sets, or each set held out whole (stricter; both are reported)")
    parser.add_argument("--sets", default=",".join(ALL_SETS), help="the labelled sets to use, comma-separated")
    parser.add_argument("--report", type=Path, help="also write the held-out evaluation as JSON here")
    parser.add_argument("--max-prompts-per-set", type=int, metavar="N",
                        help="use a seeded sample of at most N prompts of each set (to measure what training costs "
                             "on a large model; the figures then come from fewer prompts)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="auto", help="the model's dtype, as served (auto, float32, bfloat16)")


def run(args) -> int:
    import json
    import time

    from llmaccel.config import EngineConfig
    from llmaccel.engine.engine import LLMEngine
    from llmaccel.platform import describe
    from llmaccel.safety.input_filter import InputFilter
    from llmaccel.safety.rules import load_rules
    from llmaccel.safety.semantic_guard import probe_features, trained_guard_path

    layers = tuple(sorted({int(x) for x in args.layers.split(",") if x.strip()}))
    names = [n.strip() for n in args.sets.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALL_SETS]
    if unknown:
        raise ValueError(f"unknown prompt set {unknown[0]!r}; choose from {', '.join(ALL_SETS)}")
    if not any(n in JAILBREAK_SETS for n in names) or not any(n in BENIGN_SETS for n in names):
        raise ValueError("--sets needs at least one jailbreak set and one ordinary set")
    engine = LLMEngine(EngineConfig.create(args.model, device=args.device, dtype=args.dtype, semantic_guard=None))
    if layers[-1] >= engine.spec.num_layers:
        raise ValueError(f"--layers {args.layers}: {args.model} has {engine.spec.num_layers} layers (0-based)")
    if args.max_prompts_per_set is not None and args.max_prompts_per_set < 10:
        raise ValueError(f"--max-prompts-per-set {args.max_prompts_per_set}: a set needs at least 10 prompts "
                         "to hold out")
    started = time.perf_counter()
    sets = extract(engine, args.model, layers, names, limit=args.max_prompts_per_set)
    extract_seconds = time.perf_counter() - started
    check = InputFilter(load_rules(["default"])).check
    rule_hits = {s.name: [check(t).blocked_by is not None for t in s.texts] for s in sets}
    duplicates = near_duplicates(sets)
    scores = held_out_scores(sets, args.pooling, args.l2, args.ordinary_held_out, duplicates=duplicates)
    threshold = choose_threshold(sets, scores, rule_hits, args.max_false_positives)
    report = evaluation(sets, scores, rule_hits, threshold)
    other = "sets" if args.ordinary_held_out == "folds" else "folds"
    other_scores = held_out_scores(sets, args.pooling, args.l2, other, duplicates=duplicates)
    report["totals"][f"false_positives_{other}_held_out"] = evaluation(
        sets, other_scores, rule_hits, threshold)["totals"]["false_positives_both"]
    probe = probe_features(engine.scorer, engine.tokenizer, layers, args.pooling)
    spec = engine.spec
    classifier = train_classifier(sets, args.model, spec.architecture, spec.hidden_size, spec.num_layers, layers,
                                  args.pooling, threshold, probe, args.l2)
    output = args.output or trained_guard_path(args.model)
    classifier.save(output, {"held_out": report["totals"]})
    report["run"] = {"model": args.model, "layers": list(layers), "l2": args.l2, "machine": describe(),
                     "prompts": sum(len(s.texts) for s in sets), "feature_seconds": round(extract_seconds, 1),
                     "fit_seconds": round(time.perf_counter() - started - extract_seconds, 1),
                     "max_prompts_per_set": args.max_prompts_per_set}
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    for row in report["sets"]:
        kind = "unseen" if row["set"] in EVALUATION_ONLY else "attack" if row["attack"] else "ordinary"
        print(f"{row['set']:<22} {kind:<8} {row['prompts']:>5}  rules {row['rules']:6.1%}  "
              f"semantic {row['semantic']:6.1%}  both {row['both']:6.1%}")
    totals = report["totals"]
    print(f"threshold {threshold:.4f}: recall {totals['recall_both']:.1%} (rules {totals['recall_rules']:.1%}), "
          f"false positives {totals['false_positives_both']:.2%} (rules {totals['false_positives_rules']:.2%}; "
          f"ordinary {other} held out: {totals[f'false_positives_{other}_held_out']:.2%})")
    if totals["min_large_semantic"] is not None:
        print(f"lowest recall of an attack set of {LARGE_SOURCE}+ prompts: semantic "
              f"{totals['min_large_semantic']:.1%}, both {totals['min_large_both']:.1%}")
    print(f"features of {report['run']['prompts']} prompts: {extract_seconds:.0f} s (cached ones are read); "
          f"held-out fits and the shipped fit: {report['run']['fit_seconds']:.0f} s")
    print(f"wrote {output}")
    return 0


LARGE_SOURCE = 50  # the bar holds for every attack set of at least this many prompts


def evaluation(sets: list[LabelledFeatures], scores: dict[str, torch.Tensor], rule_hits: dict[str, list[bool]],
               threshold: float) -> dict:
    """Per set and in total: the fraction the rules, the semantic stage (held-out scores) and both block.
    Totals: `recall` over the trained attack sets, `recall_other` over those the rules were not written on
    (all but the in-the-wild set), `recall_unseen` over EVALUATION_ONLY, `false_positives` over ordinary
    prompts, and the lowest recall of an attack set of LARGE_SOURCE prompts or more."""
    rows, sums = [], {"attack": [0, 0, 0, 0], "other_attack": [0, 0, 0, 0], "unseen": [0, 0, 0, 0],
                      "benign": [0, 0, 0, 0]}
    for s in sets:
        semantic = [v >= threshold for v in scores[s.name].tolist()]
        counts = [len(s.texts), sum(rule_hits[s.name]), sum(semantic),
                  sum(h or v for h, v in zip(rule_hits[s.name], semantic, strict=True))]
        rows.append({"set": s.name, "attack": s.is_attack, "prompts": counts[0], "rules": counts[1] / counts[0],
                     "semantic": counts[2] / counts[0], "both": counts[3] / counts[0],
                     "scores": [round(v, 5) for v in scores[s.name].tolist()]})
        groups = ["unseen"] if s.name in EVALUATION_ONLY else ["attack", "other_attack"] \
            if s.is_attack and s.name != "inthewild" else ["attack"] if s.is_attack else ["benign"]
        for group in groups:
            sums[group] = [a + b for a, b in zip(sums[group], counts, strict=True)]
    totals: dict[str, float | None] = {"threshold": threshold}
    for group, key in (("attack", "recall"), ("other_attack", "recall_other"), ("unseen", "recall_unseen"),
                       ("benign", "false_positives")):
        n, rules, semantic, both = sums[group]
        if n:
            totals.update({f"{key}_rules": rules / n, f"{key}_semantic": semantic / n, f"{key}_both": both / n})
    large = [r for r in rows if r["attack"] and r["set"] not in EVALUATION_ONLY and r["prompts"] >= LARGE_SOURCE]
    for stage in ("semantic", "both"):
        totals[f"min_large_{stage}"] = min((r[stage] for r in large), default=None)
    return {"sets": rows, "totals": totals}
