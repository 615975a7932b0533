"""Filter rules: read from YAML or JSON files, checked once at load so a bad rule names itself.

A rule file holds a list `rules`; each rule has
  id           unique name, reported when it matches (e.g. "injection.ignore-instructions")
  action       block (refuse the request), flag (serve it, count and log it) or redact (replace the
               matched text before the model sees it)
  words        terms matched as whole words in the normalized text (Aho-Corasick)
  patterns     regular expressions over the normalized text (lower case, one space between words);
               a space in a pattern matches any run of spaces and punctuation, or none, since
               normalization may join letters that were spaced apart
  min_matches  how many distinct words or patterns must match (default 1): a vocabulary rule fires
               only on several of its terms together
  description  what it catches (optional); replacement: text put in place of a redacted match
               (default "[REDACTED]")

`default` names the input rule set shipped with llmaccel (`default_rules.yaml`), `default-output`
the output rule set (`default_output_rules.yaml`: secrets and card numbers redacted).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import StrEnum
from importlib.resources import files
from pathlib import Path

import yaml

from llmaccel.safety.normalize import normalize

SHIPPED_RULES = {"default": "default_rules.yaml", "default-output": "default_output_rules.yaml"}
_GAP = r"[\W_]*"


class Action(StrEnum):
    BLOCK = "block"
    FLAG = "flag"
    REDACT = "redact"


@dataclass(frozen=True)
class Rule:
    id: str
    action: Action
    words: tuple[str, ...] = ()  # normalized
    patterns: tuple[re.Pattern, ...] = ()
    min_matches: int = 1
    description: str = ""
    replacement: str = "[REDACTED]"
    source: str = ""  # the file it came from

    @property
    def num_terms(self) -> int:
        return len(self.words) + len(self.patterns)


def load_rules(sources: list[str]) -> list[Rule]:
    """The rules of every file in `sources` (paths, or `default`), in order; ids must be unique."""
    rules: list[Rule] = []
    seen: dict[str, str] = {}
    for source in sources:
        for rule in _load_file(source):
            if rule.id in seen:
                raise ValueError(f"{rule.source}: rule id {rule.id!r} is already defined in {seen[rule.id]}")
            seen[rule.id] = rule.source
            rules.append(rule)
    return rules


def _load_file(source: str) -> list[Rule]:
    if source in SHIPPED_RULES:
        name = SHIPPED_RULES[source]
        text = files("llmaccel.safety").joinpath(name).read_text("utf-8")
    else:
        path = Path(source).expanduser()
        if not path.is_file():
            raise ValueError(f"safety rules file {source} does not exist")
        name, text = str(path), path.read_text(encoding="utf-8")
    try:
        data = json.loads(text) if name.endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"{name}: not valid {'JSON' if name.endswith('.json') else 'YAML'} ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("rules"), list):
        raise ValueError(f"{name}: expected a mapping with a list `rules`")
    return [_parse_rule(entry, name, index) for index, entry in enumerate(data["rules"])]


def _parse_rule(entry: object, source: str, index: int) -> Rule:
    where = f"{source}: rule {index + 1}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(entry).__name__}")
    unknown = set(entry) - {"id", "action", "words", "patterns", "min_matches", "description", "replacement"}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    rule_id = entry.get("id")
    if not isinstance(rule_id, str) or not rule_id:
        raise ValueError(f"{where}: missing `id`")
    where = f"{source}: rule {rule_id!r}"
    try:
        action = Action(entry.get("action"))
    except ValueError:
        raise ValueError(f"{where}: action must be one of block, flag, redact; got {entry.get('action')!r}") from None
    words = entry.get("words") or []
    patterns = entry.get("patterns") or []
    if not all(isinstance(w, str) and w.strip() for w in [*words, *patterns]):
        raise ValueError(f"{where}: words and patterns must be non-empty strings")
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(_spaces_to_gaps(pattern)))
        except re.error as exc:
            raise ValueError(f"{where}: bad pattern {pattern!r} ({exc})") from None
    normalized = tuple(dict.fromkeys(normalize(w).strip() for w in words))
    min_matches = entry.get("min_matches", 1)
    if not words and not patterns:
        raise ValueError(f"{where}: give `words` or `patterns`")
    if not isinstance(min_matches, int) or not 1 <= min_matches <= len(normalized) + len(compiled):
        raise ValueError(f"{where}: min_matches must be between 1 and its number of words and patterns")
    return Rule(rule_id, action, normalized, tuple(compiled), min_matches, str(entry.get("description", "")),
                str(entry.get("replacement", "[REDACTED]")), source)


def _spaces_to_gaps(pattern: str) -> str:
    """Each literal space outside a character class becomes `[\\W_]*` (any run of non-letters, or none)."""
    out, in_class, escaped = [], False, False
    for char in pattern:
        if escaped:
            out.append(char)
            escaped = False
        elif char == "\\":
            out.append(char)
            escaped = True
        elif char == "[" and not in_class:
            in_class = True
            out.append(char)
        elif char == "]" and in_class:
            in_class = False
            out.append(char)
        else:
            out.append(_GAP if char == " " and not in_class else char)
    return "".join(out)
