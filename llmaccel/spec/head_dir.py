"""What marks a directory as a draft head (`llmaccel distill-head` writes it, spec/draft_head.py runs it)."""

from __future__ import annotations

import json
from pathlib import Path

HEAD_SECTION = "llmaccel_draft_head"  # the section of config.json that says what the head is


def is_draft_head(directory: str | Path) -> bool:
    """Whether `directory` holds a draft head (its config.json has the head section)."""
    config = Path(directory).expanduser() / "config.json"
    if not config.is_file():
        return False
    return HEAD_SECTION in json.loads(config.read_text(encoding="utf-8"))


def read_head_section(directory: str | Path) -> dict:
    return json.loads((Path(directory).expanduser() / "config.json").read_text(encoding="utf-8"))[HEAD_SECTION]
