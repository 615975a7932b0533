"""`bench seesaw`'s scorers: answers with known text, cloze questions cut right before their answer, distinct-n
and BLEU on hand-counted cases, and the recommended point."""

from __future__ import annotations

import math

import pytest

from llmaccel.bench.seesaw import recommend
from llmaccel.bench.seesaw_quality import (
    Question,
    bleu,
    cloze_correct,
    cloze_en,
    cloze_zh,
    contains_answer,
    distinct_n,
    normalize_words,
    score,
    self_bleu,
)
from llmaccel.data.corpora import load_corpus


def test_answers_are_found_after_squad_normalization():
    assert normalize_words("The  Eiffel-Tower, in PARIS!") == ["eiffel", "tower", "in", "paris"]
    assert contains_answer("I think it was Richard Nixon, in 1969.", ("Richard Nixon",))
    assert contains_answer("It's the Pacific Ocean.", ("Pacific",))
    assert not contains_answer("Richard was president; Nixon too", ("Richard Nixon",))  # not adjacent
    assert not contains_answer("1963 or 1964", ("1962",))
    assert contains_answer("ＩＲＥＬＡＮＤ", ("Ireland",))  # NFKC folds full-width letters
    assert not contains_answer("anything", ("the",))  # an answer of articles alone never matches


def test_cloze_scoring_english_first_word_and_chinese_prefix():
    assert cloze_correct(" Troy. Achilles then", ("Troy",))
    assert cloze_correct("troy", ("Troy",))
    assert not cloze_correct(" the city of Troy", ("Troy",))  # articles dropped, but 'city' comes first
    assert not cloze_correct("", ("Troy",))
    assert cloze_correct(" 玄德大喜", ("玄德",), chinese=True)
    assert not cloze_correct("刘玄德", ("玄德",), chinese=True)
    assert score(Question("q", ("Love",), "trivia"), "It meant love.")
    assert not score(Question("ctx", ("曹操",), "cloze-zh"), "孙权")


def test_cloze_questions_are_cut_right_before_their_answer():
    english = load_corpus("enwiki").split()
    for q in cloze_en(20, seed=3):
        words = q.prompt.split()
        at = next(i for i in range(len(english)) if english[i:i + len(words)] == words)
        assert english[at + len(words)].rstrip(".") == q.answers[0] and q.kind == "cloze-en"
    chinese = load_corpus("sanguo")
    for q in cloze_zh(20, seed=3):
        assert q.prompt + q.answers[0] in chinese and q.answers[0] in q.prompt  # named before, in the passage


def test_distinct_n_and_bleu_on_hand_counted_cases():
    assert distinct_n([[1, 2, 3], [1, 2, 4]], 2) == pytest.approx(3 / 4)  # (1,2) twice, (2,3), (2,4)
    assert distinct_n([[1]], 2) == 0.0
    assert bleu([1, 2, 3, 4], [[1, 2, 3, 4]]) == pytest.approx(1.0)
    # precisions 4/5, then add-one smoothed (3+1)/(4+1), (2+1)/(3+1), (1+1)/(2+1); equal lengths: no penalty
    expected = math.exp((math.log(4 / 5) + math.log(4 / 5) + math.log(3 / 4) + math.log(2 / 3)) / 4)
    assert bleu([1, 2, 3, 4, 5], [[1, 2, 3, 4, 6]]) == pytest.approx(expected)
    # a candidate shorter than the closest reference pays exp(1 - r/c)
    assert bleu([1, 2, 3], [[1, 2, 3, 4, 5, 6]]) == pytest.approx(math.exp(1 - 6 / 3) * math.exp(
        (math.log(1) + math.log(3 / 3) + math.log(2 / 2) + math.log(1 / 1)) / 4))
    assert bleu([7, 8], [[1, 2]]) == 0.0
    assert self_bleu([[1, 2, 3, 4]] * 3) == pytest.approx(1.0)
    assert self_bleu([[1, 2, 3, 4], [5, 6, 7, 8]]) == 0.0


def arm(name, w2, accuracy, enwiki, sanguo=20.0):
    return {"arm": name, "w2_tok_s": w2, "accuracy": {"mean": accuracy}, "perplexity": {"enwiki": enwiki,
                                                                                         "sanguo": sanguo}}


def test_the_recommended_arm_is_the_fastest_within_both_bounds():
    results = [arm("float32", 100, 30.0, 10.0), arm("bf16", 300, 29.5, 10.1), arm("int4", 400, 25.0, 10.2),
               arm("int8", 350, 29.0, 10.5), {"arm": "cascade", "accuracy": {"mean": 31.0}}]
    assert recommend(results, max_drop=2.0, max_ppl_increase=0.03) == "bf16"  # int8: +5% ppl; int4: -5 points
    assert recommend(results, max_drop=2.0, max_ppl_increase=0.06) == "int8"
    assert recommend([arm("float32", 100, 30.0, 10.0), arm("x", 200, 20.0, 10.0)], 2.0, 0.03) == "float32"
