"""RequestGroup: a user request as the engine tracks it, its n samples sharing a prompt and one output.

Each sample is an engine Request with its own detokenizer and logprobs; the group turns them into the
RequestOutput a caller sees after each step.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmaccel.engine.detokenizer import IncrementalDetokenizer
from llmaccel.engine.request import Request
from llmaccel.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


@dataclass
class Sample:
    """Engine-side state of one of a request's n samples."""

    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[Logprob] | None

    def detokenize(self, index: int = -1) -> bool:
        """Feed the request's output token at `index` (its newest by default: a step may add several) to
        the detokenizer; True if a stop string ended it."""
        request = self.request
        token = request.output_token_ids[index]
        last = index in (-1, request.num_output_tokens - 1)
        if last and request.is_finished and request.stop_reason == token:
            return False  # EOS / stop token: not part of the text
        if self.detokenizer.add_token(token):
            request.stop_reason = self.detokenizer.stop_string
            return True
        return False


@dataclass
class RequestGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[Sample]
    metrics: RequestMetrics
    error: str | None = None  # why the engine failed it (finish reason "error"), else None
    blocked: str | None = None  # why the semantic guard blocked it (finish reason "content_filter"), else None

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.samples)

    def sample_of(self, request: Request) -> Sample:
        return next(s for s in self.samples if s.request is request)

    def output(self, with_confidence: bool) -> RequestOutput:
        """The group as its caller sees it now (each sample's delta text is taken, so call once a step)."""
        completions = []
        for i, sample in enumerate(self.samples):
            request = sample.request
            confidence = (request.confidence_sum / request.num_output_tokens
                          if with_confidence and request.num_output_tokens else None)
            completions.append(CompletionOutput(
                index=i, text=sample.detokenizer.output_text, token_ids=list(request.output_token_ids),
                finish_reason=request.status.value if request.is_finished else None,
                logprobs=list(sample.logprobs) if sample.logprobs is not None else None,
                stop_reason=request.stop_reason, delta_text=sample.detokenizer.delta(request.is_finished),
                mean_confidence=confidence))
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             outputs=completions, finished=self.finished, metrics=self.metrics,
                             num_cached_tokens=self.samples[0].request.num_cached_tokens, error=self.error,
                             blocked=self.blocked, guard=_judgement(self.samples[0].request),
                             prompt_logprobs=_copy(self.samples[0].request.prompt_logprobs),
                             embedding=self.samples[0].request.embedding)


def _judgement(request: Request) -> tuple[str, float] | None:
    judgement = request.guard_judgement
    return (judgement.verdict.value, judgement.score) if judgement is not None else None


def _copy(items: list | None) -> list | None:
    return list(items) if items is not None else None
