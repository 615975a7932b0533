"""Calibration data for AWQ: the built-in chat prompts, or a user's JSONL file.

Each JSONL line is an object with a "text" (or "prompt") string, or a "messages" list in the chat
format, which goes through the model's chat template. Bad files are errors that name the line.
"""

from __future__ import annotations

import json
from pathlib import Path

MAX_SAMPLE_TOKENS = 512


def read_calibration_file(path: Path) -> list[str | list[dict]]:
    """The samples of a calibration JSONL file: strings, or chat message lists."""
    if not path.is_file():
        raise ValueError(f"calibration file {path} does not exist")
    samples: list[str | list[dict]] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"calibration file {path} is not JSONL: line {number} is not JSON ({exc.msg})") from None
        samples.append(_sample(item, path, number))
    if not samples:
        raise ValueError(f"calibration file {path} is empty; give one JSON object per line, e.g. "
                         '{"text": "..."}')
    return samples


def _sample(item: object, path: Path, number: int) -> str | list[dict]:
    if isinstance(item, dict):
        for key in ("text", "prompt"):
            if isinstance(item.get(key), str) and item[key]:
                return item[key]
        messages = item.get("messages")
        if isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
            return messages
    raise ValueError(f"calibration file {path}, line {number}: expected an object with a non-empty \"text\" or "
                     "\"prompt\" string, or a \"messages\" list of {\"role\", \"content\"}")


def calibration_token_ids(tokenizer, path: Path | None, num_samples: int) -> list[list[int]]:
    """Token ids of the first `num_samples` samples (each cut to MAX_SAMPLE_TOKENS); the built-in
    chat prompts when `path` is None."""
    if num_samples < 1:
        raise ValueError(f"--calib-samples must be at least 1, got {num_samples}")
    if path is None:
        from llmaccel.data.prompts import builtin_prompts

        samples: list[str | list[dict]] = [[{"role": "user", "content": p.prompt}] for p in builtin_prompts()]
    else:
        samples = read_calibration_file(path)
    out = []
    for sample in samples[:num_samples]:
        if isinstance(sample, list):
            sample = tokenizer.apply_chat_template(sample, tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(sample, add_special_tokens=False)[:MAX_SAMPLE_TOKENS]
        if len(ids) >= 2:
            out.append(ids)
    if not out:
        raise ValueError("no calibration sample has 2 or more tokens")
    return out
