"""The output filter: generated text through the dictionary filter, whole or as it streams.

`redact` rules replace what they match; a `block` rule stops the answer where its first match
begins (finish_reason "content_filter"). A stream holds back its last `holdback` characters until
more text or the end arrives, so a match that is still growing (a secret key, say) is redacted before
any of it is sent; a match longer than that can only be redacted from where it was still held back.
Each push checks the text from `LOOKBACK` characters before what was released, not the whole answer,
so a long stream costs linear time; a rule needing several terms sees them only within that reach.
"""

from __future__ import annotations

from llmaccel.safety.input_filter import InputFilter
from llmaccel.safety.rules import Action

LOOKBACK = 256


class OutputTextFilter:
    """One choice's text. `push` each delta; it returns the text that may be sent now."""

    def __init__(self, text_filter: InputFilter, metrics=None, holdback: int = 32) -> None:
        self.text_filter = text_filter
        self.metrics = metrics
        self.holdback = holdback
        self.raw = ""  # everything generated so far
        self.released = 0  # characters of `raw` dealt with (sent, replaced or dropped)
        self.stopped_by: str | None = None  # the block rule that ended the answer
        self._counted: set[str] = set()

    def push(self, delta: str, final: bool) -> str:
        if self.stopped_by is not None:
            return ""
        self.raw += delta
        base = max(0, self.released - LOOKBACK)
        window = self.raw[base:]
        result = self.text_filter.check(window)
        self._count(result.matches)
        end = len(self.raw)
        if result.blocked_by is not None:
            self.stopped_by = result.blocked_by.rule.id
            end = base + min(start for start, _ in self.text_filter.spans(window, [result.blocked_by.rule]))
            final = True
        redact = [m.rule for m in result.matches if m.rule.action is Action.REDACT]
        spans = [(base + start, base + stop, rule)
                 for start, stop, rule in (self.text_filter.rule_spans(window, redact) if redact else [])]
        limit = end if final else max(self.released, end - self.holdback)
        for start, stop, _ in spans:  # hold back a match that may still grow
            if not final and start >= self.released and start < limit < stop:
                limit = start
        out, pos = [], self.released
        for start, stop, rule in spans:
            if stop <= pos or start >= limit:
                continue
            if start >= pos:
                out.append(self.raw[pos:start])
                if start >= self.released:  # wholly unsent: replace it; else drop the part not yet sent
                    out.append(rule.replacement)
            pos = max(pos, min(stop, limit))
        out.append(self.raw[pos:limit])
        self.released = max(self.released, limit)
        return "".join(out)

    def whole(self, text: str) -> str:
        """Filter a complete answer at once."""
        return self.push(text, final=True)

    def _count(self, matches) -> None:
        if self.metrics is None:
            return
        for match in matches:
            if match.rule.id not in self._counted:  # each rule once per answer, however often re-checked
                self._counted.add(match.rule.id)
                self.metrics.safety_output.labels(rule=match.rule.id, action=match.rule.action.value).inc()
