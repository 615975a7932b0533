"""Incremental detokenization with stop strings.

Text is produced by decoding a sliding window of ids (prefix_offset..read_offset, as vLLM does) so
each new token costs two short decodes, and a token that ends in the middle of a multi-byte UTF-8
character ("\ufffd") is held until the character completes. Stop strings may span tokens: the text
is searched around the newest piece, cut before the stop string, and streamed deltas hold back the
last `len(longest stop) - 1` characters until they can no longer start a stop string.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from collections.abc import Callable

_PROMPT_CONTEXT = 5  # prompt tokens kept as left context, so the first word gets its leading space right


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.output_text = ""
        self.emitted = 0  # characters of output_text already handed out as deltas
        self.stop_string: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> bool:
        """Append one generated token; True when a stop string was found (text is cut before it)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return False  # nothing printable yet (partial UTF-8 or a skipped special token)
        new_text = full_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.output_text += new_text
        return self._check_stop(len(new_text))

    def _check_stop(self, new_len: int) -> bool:
        if not self.stop:
            return False
        search_from = max(0, len(self.output_text) - new_len - self.max_stop_len + 1)
        best = None
        for stop in self.stop:
            index = self.output_text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return False
        self.output_text = self.output_text[:best[0]]
        self.stop_string = best[1]
        return True

    def delta(self, finished: bool) -> str:
        """New text safe to stream: all of it once finished, else minus a possible stop-string start."""
        end = len(self.output_text)
        if not finished and self.max_stop_len > 1:
            end = max(self.emitted, end - (self.max_stop_len - 1))
        piece = self.output_text[self.emitted:end]
        self.emitted = end
        return piece


def token_bytes_function(tokenizer) -> Callable[[int], bytes]:
    """The exact bytes of one token (a byte-level BPE piece may hold half a UTF-8 character, which
    `decode([id])` would turn into U+FFFD). Used for OpenAI's `logprobs[].bytes`."""
    byte_level = False
    with contextlib.suppress(AttributeError, ValueError, KeyError, TypeError):
        decoder = json.loads(tokenizer.backend_tokenizer.to_str())["decoder"] or {}
        parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
        byte_level = any(part.get("type") == "ByteLevel" for part in parts)
    unicode_to_byte = {c: b for b, c in _bytes_to_unicode().items()}
    special = set(getattr(tokenizer, "all_special_ids", ()))

    @functools.lru_cache(maxsize=65536)
    def token_bytes(token_id: int) -> bytes:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if token_id not in special and isinstance(piece, str):
            if byte_level and all(c in unicode_to_byte for c in piece):
                return bytes(unicode_to_byte[c] for c in piece)
            match = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)  # sentencepiece byte fallback
            if match:
                return bytes([int(match.group(1), 16)])
        return tokenizer.decode([token_id]).encode("utf-8")

    return token_bytes


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, used by every byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table
