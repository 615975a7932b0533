"""Incremental detokenization with stop strings.

Text is produced by decoding a sliding window of ids (prefix_offset..read_offset, as vLLM does) so
each new token costs two short decodes, and a token that ends in the middle of a multi-byte UTF-8
character ("\ufffd") is held until the character completes. Stop strings may span tokens: the text
is searched around the newest piece, cut before the stop string, and streamed deltas hold back the
last `len(longest stop) - 1` characters until they can no longer start a stop string.
"""

from __future__ import annotations

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
