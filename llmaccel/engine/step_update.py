"""What a step's results do to the requests they belong to: a new token taken into its sample (logprobs,
confidence, timing, text and stop strings), the grammar moved over the tokens a request kept, and a user
request ended with finish reason "error". LLMEngine.step (engine.py) calls these after each step.
"""

from __future__ import annotations

from llmaccel.engine.request import Request, RequestStatus
from llmaccel.engine.request_group import RequestGroup
from llmaccel.engine.scheduler import Scheduler
from llmaccel.step_result import Sampled


def take_token(scheduler: Scheduler, group: RequestGroup, request: Request, sampled: Sampled, index: int,
               now: float) -> bool:
    """Record a sample's new token, its output token number `index`: logprobs, confidence, timing, text
    and stop strings. True when the token completed a stop string (the request is finished then)."""
    sample = group.sample_of(request)
    _, logprob, top = sampled
    if sample.logprobs is not None and logprob is not None:
        sample.logprobs.append(logprob)
    if top is not None:
        request.confidence_sum += top
    if group.metrics.first_token_time is None:
        group.metrics.first_token_time = now
    if sample.detokenize(index):
        if request.is_finished:  # it hit max_tokens on the very token that completed the stop string
            request.status = RequestStatus.FINISHED_STOPPED
        scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
        return True
    return False


def advance_grammar(scheduler: Scheduler, request: Request, first: int) -> None:
    """Move the request's grammar over the tokens it kept from output token `first` on; a finished
    output (nothing but EOS allowed next) ends the request now, without a step for the EOS."""
    request.grammar.accept(request.output_token_ids[first:])
    if request.grammar.is_finished and not request.is_finished:
        scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)


def fail_group(scheduler: Scheduler, group: RequestGroup, exc: BaseException) -> None:
    """End every sample of a user request with finish reason "error" and free its blocks."""
    group.error = f"{type(exc).__name__}: {exc}"
    for sample in group.samples:
        if not sample.request.is_finished:
            scheduler.finish_request(sample.request, RequestStatus.FINISHED_ERROR)
