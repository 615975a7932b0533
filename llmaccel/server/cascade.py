"""Cascade serving: a small model answers first; the large model answers when the small one is unsure.

Each engine request of a cascading server goes to the small engine first, with the log-probability of
every sampled token recorded. Its first `decide_tokens` tokens (all of them if the answer ends sooner;
every sample's, for n > 1) decide the route: when their mean log-probability is at least the
threshold the small answer is served as it was generated (the outputs held back so far, then the rest
as they come); below it the small request is aborted and the large engine answers from the start.
So a response begins only after the decision, streamed or not: `decided` resolves before the first
byte, and the HTTP layer sends the route as the `x-llmaccel-route` header. `llmaccel bench cascade
--decide-tokens N` measures the same rule offline; its cost/agreement curve is where to pick the
threshold. A prompt too long for the small model's context goes to the large one directly.

The small engine is a guest of the large one's (AsyncEngine's `host`): one thread steps both, one step
of each in turn, since a second thread running OpenMP regions makes every step of both slower.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from llmaccel.engine.request_stream import RequestStream
from llmaccel.errors import InvalidRequestError
from llmaccel.outputs import RequestOutput
from llmaccel.sampling_params import SamplingParams
from llmaccel.server.result_streams import FlightSubscriber
from llmaccel.spec.build import check_same_tokenizer

if TYPE_CHECKING:
    from llmaccel.engine.async_engine import AsyncEngine
    from llmaccel.engine.engine import LLMEngine
    from llmaccel.server.metrics import ServerMetrics

SMALL, LARGE = "small", "large"


@dataclass(frozen=True)
class CascadeRule:
    threshold: float  # route to the large model when the small answer's mean token log-probability is below
    decide_tokens: int  # ... over the answer's first this many tokens (ServerConfig checks both)

    def is_decided(self, output: RequestOutput) -> bool:
        return output.finished or all(c.finish_reason is not None or len(c.token_ids) >= self.decide_tokens
                                      for c in output.outputs)

    def confidence(self, output: RequestOutput) -> float:
        """Mean log-probability of every sample's first `decide_tokens` tokens (0 for an empty answer:
        nothing in it is unsure)."""
        values = [lp.logprob for c in output.outputs for lp in (c.logprobs or [])[:self.decide_tokens]]
        return statistics.fmean(values) if values else 0.0


def check_cascade(small: LLMEngine, large: LLMEngine, small_name: str) -> None:
    """Raise ValueError unless the small model shares the large one's tokenizer and holds fewer weight bytes
    (a decode step reads every weight: fewer bytes is what makes the small answer cheaper)."""
    check_same_tokenizer(small_name, small.spec, small.tokenizer, large.spec, large.tokenizer, role="cascade model")
    if small.weight_bytes >= large.weight_bytes:
        raise ValueError(f"the cascade model {small_name} is not smaller than the model: its weights take "
                         f"{small.weight_bytes / 1e6:.0f} MB, the model's {large.weight_bytes / 1e6:.0f} MB; "
                         "--cascade-small needs a cheaper model (fewer layers, a student from `llmaccel distill`, "
                         "or a quantized one)")


class CascadeRouter:
    """Opens cascaded requests on two running engines and counts where they went."""

    def __init__(self, small: AsyncEngine, large: AsyncEngine, rule: CascadeRule, metrics: ServerMetrics) -> None:
        self.small, self.large, self.rule, self.metrics = small, large, rule, metrics

    def open(self, ids: list[int], params: SamplingParams, request_id: str, timeout: float | None) -> CascadeStream:
        """Raises as AsyncEngine.add_request does, before anything is queued."""
        return CascadeStream(self, ids, params, request_id, timeout)

    def record(self, route: str, confidence: float | None) -> None:
        self.metrics.cascade_routes.labels(route=route).inc()
        if confidence is not None:
            self.metrics.cascade_confidence.observe(confidence)


class CascadeStream:
    """RequestStream's interface over one cascaded request; `decided` resolves to its route."""

    def __init__(self, router: CascadeRouter, ids: list[int], params: SamplingParams, request_id: str,
                 timeout: float | None) -> None:
        self.request_id = request_id
        self.finished = False
        self.route: str | None = None
        self._router, self._ids, self._params = router, ids, params
        loop = asyncio.get_running_loop()
        self._deadline = None if timeout is None else loop.time() + timeout
        self._held: list[RequestOutput] = []  # the small answer's outputs up to the decision
        self._rest: AsyncIterator[RequestOutput] | None = None  # the chosen request's outputs after them
        self._streams: list[RequestStream] = []
        self.decided: asyncio.Future[str]
        try:
            logged = replace(params, logprobs=params.logprobs if params.logprobs is not None else 0)
            small = router.small.add_request(ids, logged, request_id, timeout)
        except InvalidRequestError:  # e.g. longer than the small model's context: the large one answers
            large = router.large.add_request(ids, params, request_id, timeout)
            self._streams.append(large)
            self._rest = aiter(large)
            self.decided = loop.create_future()
            self.decided.set_result(self._settle(LARGE, None))
            return
        self._streams.append(small)
        self.decided = loop.create_task(self._decide(small))

    def _settle(self, route: str, confidence: float | None) -> str:
        self.route = route
        self._router.record(route, confidence)
        return route

    async def _decide(self, small: RequestStream) -> str:
        rule = self._router.rule
        outputs = aiter(small)
        async for output in outputs:  # leaving the loop early does not close the stream: `_rest` goes on
            self._held.append(output)
            if rule.is_decided(output):
                break
        confidence = rule.confidence(self._held[-1])
        if confidence >= rule.threshold:
            self._rest = outputs
            return self._settle(SMALL, confidence)
        small.close()  # aborted: its KV blocks are freed at the small engine's next step
        self._held = []
        loop = asyncio.get_running_loop()
        timeout = None if self._deadline is None else max(self._deadline - loop.time(), 1e-3)
        large = self._router.large.add_request(self._ids, self._params, self.request_id, timeout)
        self._streams.append(large)
        self._rest = aiter(large)
        return self._settle(LARGE, confidence)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            await self.decided
            pending = self._held
            self._held = []
            for output in pending:
                self.finished = output.finished
                yield self._as_asked(output)
            if not self.finished:
                async for output in self._rest:
                    self.finished = output.finished
                    yield self._as_asked(output)
        finally:
            self.close()

    def _as_asked(self, output: RequestOutput) -> RequestOutput:
        """The small answer without the log-probabilities the cascade asked for and the client did not."""
        if self._params.logprobs is not None or self.route != SMALL:
            return output
        return replace(output, outputs=[replace(c, logprobs=None) for c in output.outputs])

    def close(self) -> None:
        """Abort whatever still runs; safe to call more than once."""
        if not self.decided.done():
            self.decided.cancel()
        elif not self.decided.cancelled():
            self.decided.exception()  # retrieved: a failed decision is reported to whoever awaited it
        for stream in self._streams:
            stream.close()


async def cascade_route(stream: object) -> str:
    """The route of a job's stream once decided: a cascaded request's own, that of the identical request
    in flight it shares (result_streams.FlightSubscriber), or "cache" for a stored result."""
    source = stream.flight.stream if isinstance(stream, FlightSubscriber) else stream
    if isinstance(source, CascadeStream):
        return await asyncio.shield(source.decided)
    return "cache"
