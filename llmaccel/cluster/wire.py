"""What crosses from a replica to the ingress per streamed update: only what is new.

An engine output carries the whole prompt and everything generated so far; sent as is on every step
it costs O(length^2) serialization over a request. A replica's OutputEncoder sends each sample's new
tokens, new logprobs and the new end of its text, and the prompt only once; the ingress's
OutputDecoder rebuilds the engine's RequestOutput, so the server above cannot tell the difference.
The encoder also coalesces: the outputs of several steps taken at once become one update (their
delta texts joined), which is how a replica sends at most one update per stream interval.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmaccel.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


@dataclass
class SampleDelta:
    index: int
    new_token_ids: list[int]
    new_logprobs: list[Logprob] | None
    text_kept: int  # characters of the previously sent text that stand (a stop string may cut text back)
    text_tail: str
    delta_text: str
    finish_reason: str | None
    stop_reason: str | int | None
    mean_confidence: float | None


@dataclass
class OutputDelta:
    request_id: str
    samples: list[SampleDelta]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int
    error: str | None
    prompt: str | None = None  # first update only
    prompt_logprobs: list[Logprob | None] | None = None  # first update only


def _kept(previous: str, text: str) -> int:
    if text.startswith(previous):
        return len(previous)
    keep = 0
    for a, b in zip(previous, text, strict=False):
        if a != b:
            break
        keep += 1
    return keep


class OutputEncoder:
    def __init__(self) -> None:
        self._sent: dict[int, tuple[int, int, str]] = {}  # index -> (tokens, logprobs, text) already sent
        self._deltas: dict[int, str] = {}
        self._latest: RequestOutput | None = None
        self._first = True

    def absorb(self, output: RequestOutput) -> None:
        for c in output.outputs:
            self._deltas[c.index] = self._deltas.get(c.index, "") + c.delta_text
        self._latest = output

    @property
    def has_news(self) -> bool:
        return self._latest is not None

    def encode(self) -> OutputDelta:
        out, self._latest = self._latest, None
        samples = []
        for c in out.outputs:
            tokens, logprobs, text = self._sent.get(c.index, (0, 0, ""))
            kept = _kept(text, c.text)
            samples.append(SampleDelta(
                c.index, c.token_ids[tokens:], c.logprobs[logprobs:] if c.logprobs is not None else None, kept,
                c.text[kept:], self._deltas.pop(c.index, ""), c.finish_reason, c.stop_reason, c.mean_confidence))
            self._sent[c.index] = (len(c.token_ids), len(c.logprobs or ()), c.text)
        first, self._first = self._first, False
        return OutputDelta(out.request_id, samples, out.finished, out.metrics, out.num_cached_tokens, out.error,
                           out.prompt if first else None, out.prompt_logprobs if first else None)


class OutputDecoder:
    def __init__(self, prompt_token_ids: list[int]) -> None:
        self.prompt_token_ids = prompt_token_ids
        self._state: dict[int, tuple[list[int], list[Logprob] | None, str]] = {}
        self._prompt: str | None = None
        self._prompt_logprobs: list[Logprob | None] | None = None

    def decode(self, delta: OutputDelta) -> RequestOutput:
        if delta.prompt is not None:
            self._prompt = delta.prompt
        if delta.prompt_logprobs is not None:
            self._prompt_logprobs = delta.prompt_logprobs
        outputs = []
        for s in delta.samples:
            tokens, logprobs, text = self._state.get(s.index, ([], None, ""))
            tokens = tokens + s.new_token_ids
            if s.new_logprobs is not None:
                logprobs = (logprobs or []) + s.new_logprobs
            text = text[:s.text_kept] + s.text_tail
            self._state[s.index] = (tokens, logprobs, text)
            outputs.append(CompletionOutput(s.index, text, tokens, s.finish_reason,
                                            list(logprobs) if logprobs is not None else None, s.stop_reason,
                                            s.delta_text, s.mean_confidence))
        return RequestOutput(delta.request_id, self._prompt, self.prompt_token_ids, outputs, delta.finished,
                             delta.metrics, delta.num_cached_tokens, self._prompt_logprobs, delta.error)
