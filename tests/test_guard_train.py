"""The semantic guard's held-out evaluation (safety/guard_train.py) on planted features: a source that
shares what the other attack sets have in common is caught held out, one that shares nothing is not, and
the figures say so; evaluation-only sets never reach a classifier; every ordinary prompt is scored by a
classifier that never saw it."""

from __future__ import annotations

import pytest
import torch

from llmaccel.safety.guard_train import (
    EVALUATION_ONLY,
    LabelledFeatures,
    _training_data,
    choose_threshold,
    evaluation,
    held_out_scores,
    train_classifier,
)

DIM = 6


def _set(name: str, attack: bool, count: int, direction: int | None, seed: int, strength: float = 6.0
         ) -> LabelledFeatures:
    """`count` prompts: noise, plus `strength` along `direction` (None: noise only)."""
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(count, DIM, generator=generator)
    if direction is not None:
        features[:, direction] += strength
    texts = [f"{name} prompt number {i} with its own words {seed}" for i in range(count)]
    return LabelledFeatures(name, attack, texts, features, features)


def _sources() -> list[LabelledFeatures]:
    return [_set("family-a", True, 60, 0, 1), _set("family-b", True, 60, 0, 2),
            _set("planted-shared", True, 50, 0, 3),  # held out, but shares direction 0 with the others
            _set("planted-novel", True, 50, 4, 4),  # held out, and direction 4 is nowhere else
            _set("ordinary-a", False, 200, None, 5), _set("ordinary-b", False, 200, None, 6)]


def test_a_held_out_source_that_shares_the_families_signal_is_caught_and_a_novel_one_is_not():
    sets = _sources()
    hits = {s.name: [False] * len(s.texts) for s in sets}
    scores = held_out_scores(sets, "mean", l2=1e-2)
    threshold = choose_threshold(sets, scores, hits, 0.01)
    report = evaluation(sets, scores, hits, threshold)
    semantic = {r["set"]: r["semantic"] for r in report["sets"]}
    assert semantic["planted-shared"] >= 0.9
    assert semantic["planted-novel"] <= 0.1
    assert report["totals"]["false_positives_semantic"] <= 0.01
    # the figure the issue asks for is the lowest recall among sources of 50+ prompts: the novel family's
    assert report["totals"]["min_large_semantic"] == semantic["planted-novel"]
    # the shipped classifier, trained on every set, knows both families
    classifier = train_classifier(sets, "m", "A", DIM, 2, (0,), "mean", threshold, torch.zeros(DIM))
    novel = next(s for s in sets if s.name == "planted-novel")
    assert (classifier.score(novel.mean) >= threshold).float().mean() >= 0.8


def test_an_evaluation_only_set_reaches_no_classifier_and_is_reported_as_unseen():
    (name,) = EVALUATION_ONLY
    sets = _sources()
    planted = _set(name, True, 40, 5, 7, strength=50.0)  # would dominate any fit that saw it
    with_it = train_classifier([*sets, planted], "m", "A", DIM, 2, (0,), "mean", 0.5, torch.zeros(DIM))
    without = train_classifier(sets, "m", "A", DIM, 2, (0,), "mean", 0.5, torch.zeros(DIM))
    assert torch.equal(with_it.weight, without.weight) and name not in with_it.sources
    scores = held_out_scores([*sets, planted], "mean")
    assert torch.equal(scores["family-a"], held_out_scores(sets, "mean")["family-a"])
    hits = {s.name: [False] * len(s.texts) for s in [*sets, planted]}
    totals = evaluation([*sets, planted], scores, hits, 0.5)["totals"]
    assert "recall_unseen_semantic" in totals and totals["recall_unseen_semantic"] < 0.5  # direction 5: unseen


def test_every_ordinary_prompt_is_scored_by_a_classifier_that_did_not_see_it():
    sets = _sources()
    # one ordinary prompt sits on the attack families' mean, with a feature of its own (direction 5) that a fit
    # trained on it uses to score it ordinary (0.44); a fit that never saw it has no such weight
    sets[4].mean[7] = sets[4].last[7] = torch.tensor([6.0, 0, 0, 0, 0, 30.0])
    seen = train_classifier(sets, "m", "A", DIM, 2, (0,), "mean", 0.5, torch.zeros(DIM))
    assert seen.score(sets[4].mean[7]) < 0.6
    for ordinary in ("folds", "sets"):
        scores = held_out_scores(sets, "mean", ordinary=ordinary)
        assert scores["ordinary-a"][7] > 0.9, ordinary
        assert all(len(scores[s.name]) == len(s.texts) for s in sets)


def test_each_set_weighs_one_over_the_square_root_of_its_size():
    sets = _sources()
    _, labels, weights = _training_data(sets, "mean", lambda s, i: True)
    assert weights[0] == 60 ** -0.5 and weights[-1] == 200 ** -0.5
    assert int(labels.sum()) == 60 + 60 + 50 + 50


def test_the_tradeoff_curve_counts_recall_over_trained_attack_sets_only():
    from llmaccel.bench.semantic_guard import tradeoff

    (name,) = EVALUATION_ONLY
    sets = [_set("family-a", True, 2, None, 1), _set(name, True, 2, None, 2), _set("ordinary-a", False, 2, None, 3)]
    scores = {"family-a": torch.tensor([0.9, 0.1]), name: torch.tensor([0.0, 0.0]),
              "ordinary-a": torch.tensor([0.2, 0.3])}
    hits = {s.name: [False, False] for s in sets}
    top = max(tradeoff(sets, scores, hits), key=lambda p: p["threshold"])
    assert top["threshold"] == pytest.approx(0.9) and top["recall_semantic"] == 0.5 and top["fp_semantic"] == 0.0
