"""Prompt sources every part of llmaccel reads: the 200 built-in chat prompts (English and Chinese, with
realistic answer lengths) shipped in the package, and ShareGPT files. The benchmarks, the quantizer's
calibration and quality watch, the safety sets and distillation all take them from here.
The built-in set (chat_prompts.jsonl) was written once by tools/make_prompts.py, deleted since (`git show
fd29730^:tools/make_prompts.py`): each prompt's target length drawn once, seeded, from a log-normal spread (most
answers short, a tail to 512 tokens, as in chat traffic); it is data now, changed by editing the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path


@dataclass(frozen=True)
class BuiltinPrompt:
    prompt: str
    lang: str
    output_len: int  # the target output length drawn for this prompt


def builtin_prompts() -> list[BuiltinPrompt]:
    """The shipped set: 200 chat prompts (English and Chinese) with realistic target lengths."""
    text = files("llmaccel.data").joinpath("chat_prompts.jsonl").read_text(encoding="utf-8")
    return [BuiltinPrompt(**json.loads(line)) for line in text.splitlines() if line.strip()]


def read_sharegpt(path: Path) -> list[dict]:
    """The conversations of a ShareGPT JSON file (a list of {"conversations": [{"from", "value"}]}).

    Read item by item, so a file cut off in the middle (as some published copies are) still yields
    every complete conversation before the cut."""
    text = Path(path).read_text(encoding="utf-8")
    start = text.find("[")
    if start < 0:
        raise ValueError(f"{path}: not a ShareGPT file (expected a JSON list of conversations)")
    decoder = json.JSONDecoder()
    items, pos = [], start + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # truncated file: keep what came before
        items.append(item)
    if not items:
        raise ValueError(f"{path}: no complete conversation found")
    return items


# The system prompt of the multi-turn benchmarks (bench multiturn, bench replicas): one shared prefix.
SYSTEM_PROMPT = ("You are a helpful assistant for a travel company. Answer briefly and politely, in the language "
                 "of the question. If you do not know something, say so; never invent prices, dates or "
                 "bookings. Keep every answer under five sentences.")
