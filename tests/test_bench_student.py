"""`llmaccel bench student`: the agreement figures on known answers, and a whole run through the CLI on tiny models
(a model against itself agrees on every answer; against another model it does not)."""

from __future__ import annotations

import json

import pytest

from llmaccel.bench.student import agreement
from llmaccel.cli import main


def test_agreement_counts_identical_answers_and_the_shared_start_of_each():
    teacher = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10]]
    student = [[1, 2, 3, 4], [5, 9], [1, 8, 9, 10]]
    got = agreement(teacher, student)
    assert got["identical_answers"] == pytest.approx(1 / 3)
    assert got["mean_common_prefix_share"] == pytest.approx((1.0 + 0.5 + 0.0) / 3)
    assert agreement([[1, 2]], [[1, 2, 3]]) == {"identical_answers": 0.0, "mean_common_prefix_share": 1.0}


@pytest.mark.parametrize("other", ["llama-gqa", "llama-tied"])
def test_a_run_writes_both_models_rates_memory_and_agreement(tiny_model_dirs, tmp_path, capsys, other):
    teacher, student = tiny_model_dirs["llama-gqa"], tiny_model_dirs[other]
    out = tmp_path / "student.json"
    code = main(["bench", "student", "--teacher", str(teacher), "--student", str(student), "--rounds", "1",
                 "--single-tokens", "4", "--batch", "3", "--batch-tokens", "4", "--answers", "4",
                 "--answer-tokens", "6", "--dtype", "float32", "--result-json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    for name in ("teacher", "student"):
        assert set(result["tokens_per_second"][name]) == {"batch_1", "batch_3"}
        assert all(rate > 0 for rates in result["tokens_per_second"][name].values() for rate in rates)
        assert result["weight_bytes"][name] > 0
    assert (result["greedy_agreement"]["identical_answers"] == 1.0) == (other == "llama-gqa")
    assert "batch_1: teacher" in capsys.readouterr().out
