"""The output guard: checks finished continuations against a reference distribution and resamples
anomalous ones at a higher temperature.

A continuation is checked when it is drawn for the random share `sample_rate`, or when it is
confident: the mean top probability of its sampling distributions is at least `confidence` (the
engine records it while sampling). A check scores the continuation under the served and the
reference distributions (`LLMEngine.divergence`, in the engine thread between steps) and compares
the mean per-token KL with `max_kl`. An anomalous answer is generated again, up to `retries` times,
at temperature max(T, `retry_temperature`) + 0.25 per further retry; the first retry under the
threshold is served ("resampled"), and if none is, the one with the lowest KL is served, flagged.

A streamed answer is checked when it ends, before its final chunk: the client has seen every token
by then, so it is not resampled; the final chunk says whether it was anomalous. When the KV pool has
no room to score an answer (a full server), it is served unchecked and counted as skipped.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from llmaccel.engine.scoring import Divergence
from llmaccel.outputs import CompletionOutput
from llmaccel.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

TEMPERATURE_STEP = 0.25


@dataclass(frozen=True)
class GuardConfig:
    sample_rate: float = 0.0  # share of continuations checked at random
    confidence: float | None = None  # also check every continuation at least this confident; None: never
    max_kl: float = 0.35  # mean per-token KL(served || reference) above this is an anomaly
    retries: int = 2  # generations tried again for an anomalous answer
    retry_temperature: float = 1.0  # the first retry's temperature, at least

    def __post_init__(self) -> None:
        if not 0 <= self.sample_rate <= 1:
            raise ValueError(f"guard sample rate must be in [0, 1], got {self.sample_rate}")
        if self.confidence is not None and not 0 < self.confidence <= 1:
            raise ValueError(f"guard confidence must be in (0, 1], got {self.confidence}")
        if self.max_kl <= 0 or self.retries < 0 or self.retry_temperature <= 0:
            raise ValueError("guard max_kl and retry_temperature must be > 0 and retries >= 0")

    @property
    def enabled(self) -> bool:
        return self.sample_rate > 0 or self.confidence is not None


@dataclass(frozen=True)
class GuardReport:
    verdict: str  # "pass", "resampled", "flagged" (every try anomalous) or "anomalous" (a stream: seen already)
    output: CompletionOutput  # the answer to serve
    divergence: Divergence  # of the answer served
    attempts: int  # generations scored
    first_kl: float  # the first answer's mean KL, before any resample

    def as_dict(self) -> dict:
        return {"index": self.output.index, "verdict": self.verdict, "mean_kl": round(self.divergence.mean_kl, 6),
                "attempts": self.attempts}


Measure = Callable[[list[int], list[int], SamplingParams], Awaitable[Divergence]]
Regenerate = Callable[[SamplingParams], Awaitable[CompletionOutput]]


class OutputGuard:
    def __init__(self, config: GuardConfig, measure: Measure, metrics, seed: int | None = None) -> None:
        self.config = config
        self.measure = measure  # scores a continuation (in the engine thread)
        self.metrics = metrics
        self._random = random.Random(seed)
        self.num_reviewed = 0  # first answers checked
        self.num_anomalous = 0

    def wants(self, output: CompletionOutput) -> bool:
        """Whether to check this continuation: drawn at random, or confident enough."""
        if not output.token_ids:
            return False
        confident = (self.config.confidence is not None and output.mean_confidence is not None
                     and output.mean_confidence >= self.config.confidence)
        return confident or self._random.random() < self.config.sample_rate

    async def review(self, prompt_ids: list[int], params: SamplingParams, output: CompletionOutput,
                     regenerate: Regenerate | None) -> GuardReport | None:
        """Check `output` if it is due; resample it if anomalous (not when `regenerate` is None: a
        stream). None when it was not checked. A constrained answer (structured outputs) is not checked:
        its grammar, not the model, chose where the two distributions part."""
        if params.structured_outputs is not None or not self.wants(output):
            return None
        try:
            score = await self._check(prompt_ids, output, params)
        except RuntimeError as exc:  # no free KV blocks to score with now: serve it unchecked, not fail it
            self.metrics.guard_skipped.inc()
            logger.warning("output guard: answer served unchecked (%s)", exc)
            return None
        anomalous = score.mean_kl > self.config.max_kl
        self.num_reviewed += 1
        self.num_anomalous += anomalous
        self.metrics.guard_abnormal_ratio.set(self.num_anomalous / self.num_reviewed)
        if not anomalous:
            return GuardReport("pass", output, score, 1, score.mean_kl)
        self.metrics.guard_anomalies.inc()
        if regenerate is None:
            logger.warning("output guard: streamed answer anomalous (mean KL %.3f > %.3f), already sent",
                           score.mean_kl, self.config.max_kl)
            return GuardReport("anomalous", output, score, 1, score.mean_kl)
        best, best_score = output, score
        for attempt in range(self.config.retries):
            temperature = max(params.temperature, self.config.retry_temperature) + TEMPERATURE_STEP * attempt
            seed = None if params.seed is None else params.seed + 1 + attempt
            retry_params = replace(params, n=1, temperature=temperature, seed=seed)
            candidate = replace(await regenerate(retry_params), index=output.index)
            self.metrics.guard_resamples.inc()
            candidate_score = await self._check(prompt_ids, candidate, retry_params)
            if candidate_score.mean_kl <= self.config.max_kl:
                self.metrics.guard_resample_successes.inc()
                return GuardReport("resampled", candidate, candidate_score, attempt + 2, score.mean_kl)
            if candidate_score.mean_kl < best_score.mean_kl:
                best, best_score = candidate, candidate_score
        self.metrics.guard_flagged.inc()
        logger.warning("output guard: every try anomalous (best mean KL %.3f > %.3f); serving it flagged",
                       best_score.mean_kl, self.config.max_kl)
        return GuardReport("flagged", best, best_score, self.config.retries + 1, score.mean_kl)

    async def _check(self, prompt_ids: list[int], output: CompletionOutput, params: SamplingParams) -> Divergence:
        score = await self.measure(prompt_ids, output.token_ids, params)
        self.metrics.observe_guard_check(score.mean_kl)
        return score


def worst_verdict(reports: list[GuardReport]) -> str | None:
    """One word for a response's header: the worst verdict of its choices, None if none was checked."""
    order = ["pass", "resampled", "anomalous", "flagged"]
    verdicts = [r.verdict for r in reports]
    return max(verdicts, key=order.index) if verdicts else None
