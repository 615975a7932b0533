"""The Chinese test bed: at least 6,000 prompts, every source in it, no two equal under the dedup rule, and
`bench serve --dataset chinese` drawing from it."""

from __future__ import annotations

import argparse

from llmaccel.bench.serve import sample_requests
from llmaccel.data.chinese_prompts import SOURCES, chinese_prompts, dedup_key, source_counts


def test_dedup_key_ignores_width_whitespace_and_punctuation():
    assert dedup_key("请用一句话概括：\n  今天，天气很好！") == dedup_key("请用一句话概括:今天天气很好!")
    assert dedup_key("ＡＢＣ１２３") == "ABC123"
    assert dedup_key("天气很好") != dedup_key("天气不好")


def test_the_set_has_every_source_and_no_duplicates():
    prompts = chinese_prompts()
    assert len(prompts) >= 6000
    counts = source_counts(prompts)
    assert set(counts) == set(SOURCES) and min(counts.values()) >= 50
    keys = [dedup_key(p.prompt) for p in prompts]
    assert len(set(keys)) == len(keys)
    assert all(8 <= p.output_len <= 512 for p in prompts)
    assert all(any("\u4e00" <= c <= "\u9fff" for c in p.prompt) for p in prompts)  # short chat ones: 你好


def test_bench_serve_samples_the_chinese_set(tiny_tokenizer):
    args = argparse.Namespace(dataset="chinese", num_prompts=20, output_len=None, seed=3)
    first = sample_requests(args, tiny_tokenizer)
    assert len(first) == 20 and first == sample_requests(args, tiny_tokenizer)  # seeded
    texts = {p.prompt for p in chinese_prompts()}
    assert all(r.prompt in texts and r.prompt_len > 0 for r in first)
    other = sample_requests(argparse.Namespace(**{**vars(args), "seed": 4}), tiny_tokenizer)
    assert [r.prompt for r in other] != [r.prompt for r in first]
