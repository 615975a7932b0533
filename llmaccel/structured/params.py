"""StructuredOutputsParams: what a request's output must match (vLLM's name and fields).

Exactly one of `json` (a JSON schema), `json_object` (any JSON object), `regex`, `choice` (one of
these strings) or `grammar` (Lark, or llama.cpp's GBNF) is set. The schema is kept as compact JSON
text, so equal schemas are one result-cache key and one compiled grammar. `grammar_text` turns it
into llguidance's grammar; whether that grammar is valid is the compiler's question
(structured/compiler.py), asked when the request arrives.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import llguidance

# The largest schema, regex or grammar a request may carry: a compiled grammar is built per request,
# and one of a megabyte would stall the engine loop for everyone else.
MAX_SPEC_BYTES = 64 * 1024
# JSON as Python's json.dumps writes it: models have read a lot of it, and no whitespace run can loop.
_KINDS = ("json", "json_object", "regex", "choice", "grammar")
KIND_NAMES = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice",
              "grammar": "grammar"}
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | None = None  # a JSON schema (given as a dict or as JSON text; kept as canonical text)
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    # where the constraint came from, for errors: "response_format", "guided_json", "tool_choice", ...
    source: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        if self.json is not None:
            object.__setattr__(self, "json", _canonical_schema(self.json, self.source))
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, str) or not all(isinstance(c, str) for c in choice) or not choice:
                raise ValueError(f"{self.source}: choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(choice))
        given = [name for name in _KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"{self.source}: give exactly one of json, json_object, regex, choice or grammar"
                             + (f" (got {', '.join(given)})" if given else ""))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{self.source}: {name} must be a string")
        size = len(self.spec_text.encode())
        if size > MAX_SPEC_BYTES:
            raise ValueError(f"{self.source}: the {KIND_NAMES[self.kind]} is {size} bytes; at most {MAX_SPEC_BYTES} "
                             "are allowed")

    @property
    def kind(self) -> str:
        return next(name for name in _KINDS if getattr(self, name) not in (None, False))

    @property
    def spec_text(self) -> str:
        if self.choice is not None:
            return json.dumps(list(self.choice))
        return {"json": self.json, "json_object": "{}", "regex": self.regex, "grammar": self.grammar}[self.kind]

    def grammar_text(self) -> str:
        """llguidance's grammar for this constraint. Raises ValueError for a grammar it cannot read."""
        if self.json is not None:
            return llguidance.LLMatcher.grammar_from_json_schema(self.json, defaults=JSON_OPTIONS)
        if self.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return llguidance.grammar_from("choice", list(self.choice))
        return llguidance.grammar_from("grammar", self.grammar)  # Lark, or GBNF converted to Lark


def _canonical_schema(schema: str | Mapping, source: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source}: the JSON schema is not valid JSON ({exc})") from None
    if isinstance(schema, bool):  # true accepts anything, false nothing: JSON Schema's own shorthands
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, Mapping):
        raise ValueError(f"{source}: a JSON schema must be an object, got {type(schema).__name__}")
    # key order kept: the output writes the properties in the schema's order
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
