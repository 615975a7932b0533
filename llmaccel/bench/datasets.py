"""Prompt sets for the benchmarks."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.resources import files


@dataclass(frozen=True)
class BenchPrompt:
    prompt: str
    lang: str
    output_len: int  # the target output length drawn for this prompt


def builtin_prompts() -> list[BenchPrompt]:
    """The shipped set: 200 chat prompts (English and Chinese) with realistic target lengths."""
    text = files("llmaccel.bench").joinpath("data/chat_prompts.jsonl").read_text(encoding="utf-8")
    return [BenchPrompt(**json.loads(line)) for line in text.splitlines() if line.strip()]
