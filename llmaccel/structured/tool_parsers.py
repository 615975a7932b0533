"""Tool-call parsers: a model's text -> content and function calls, per chat-template family.

A parser knows how one family writes a call (`HERMES` below: Hermes 2 Pro, Qwen2/2.5/3, SmolLM3 and
the fallback prompt of server/tools.py) and reads it back, whole (`extract`) or as the text streams
(`stream`). To add a family: write a class with the two methods and one line in `TOOL_PARSERS`; the
server picks it with `--tool-call-parser NAME` (vLLM's flag, names as vLLM's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass
class Extracted:
    content: str | None  # text outside the calls; None when there is none
    calls: list[ParsedCall] = field(default_factory=list)


class HermesToolParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, anywhere in the text."""

    name = "hermes"
    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def extract(self, text: str) -> Extracted:
        stream = self.stream()
        content, calls = stream.push(text)
        more, tail_calls = stream.finish()
        content += more
        return Extracted(content if content.strip() else None, calls + tail_calls)

    def stream(self) -> HermesStream:
        return HermesStream(self)


class HermesStream:
    """Feed text as it comes; get back content that is surely not part of a call, and each call once its
    closing tag arrives. Text that may be the start of `<tool_call>` waits for the next piece."""

    def __init__(self, parser: HermesToolParser) -> None:
        self.parser = parser
        self.buffer = ""
        self.in_call = False

    def push(self, text: str) -> tuple[str, list[ParsedCall]]:
        self.buffer += text
        content, calls = [], []
        while True:
            if not self.in_call:
                at = self.buffer.find(self.parser.open_tag)
                if at < 0:
                    keep = _partial_tag_length(self.buffer, self.parser.open_tag)
                    content.append(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                content.append(self.buffer[:at])
                self.buffer = self.buffer[at + len(self.parser.open_tag):]
                self.in_call = True
            at = self.buffer.find(self.parser.close_tag)
            if at < 0:
                break
            call = _parse_call(self.buffer[:at])
            if call is not None:
                calls.append(call)
            else:  # not a call after all: the model's own text
                content.append(self.parser.open_tag + self.buffer[:at + len(self.parser.close_tag)])
            self.buffer = self.buffer[at + len(self.parser.close_tag):]
            self.in_call = False
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """The rest at the end: an unclosed call still counts when its JSON is whole."""
        rest, self.buffer = self.buffer, ""
        if self.in_call:
            self.in_call = False
            call = _parse_call(rest)
            return ("", [call]) if call is not None else (self.parser.open_tag + rest, [])
        return rest, []


def _parse_call(body: str) -> ParsedCall | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text already
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _partial_tag_length(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


TOOL_PARSERS = {"hermes": HermesToolParser}


def tool_parser(name: str) -> HermesToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()
