"""What the engine hands back: one RequestOutput per request, one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)  # top-N alternatives: token id -> logprob
    rank: int | None = None  # 1 + the tokens more likely there (prompt logprobs carry it)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    logprobs: list[Logprob] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    delta_text: str = ""  # text new since this sample's previous output, safe to stream (see detokenizer)
    mean_confidence: float | None = None  # mean top probability of its sampling distributions, if recorded


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    guard_verdict_time: float | None = None  # when the semantic input guard judged the prompt
    spec_draft_tokens: int = 0  # speculative decoding: drafts proposed for this request ...
    spec_accepted_tokens: int = 0  # ... and kept


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    # with SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing before it)
    prompt_logprobs: list[Logprob | None] | None = None
    error: str | None = None  # why the engine failed this request (finish reason "error"), else None
    blocked: str | None = None  # why the semantic guard blocked it (finish reason "content_filter"), else None
    guard: tuple[str, float] | None = None  # the semantic guard's (verdict, score), once judged
    embedding: list[float] | None = None  # an embedding request's vector (SamplingParams.pooling), once pooled
