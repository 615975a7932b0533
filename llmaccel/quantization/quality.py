"""Quality watch: perplexity on a small fixed validation slice, measured the same way at
quantization time (the float reference) and in production (the served model), so a drift shows.

The slice is the first VALIDATION_TOKENS tokens of the built-in chat prompts (English and Chinese),
joined by blank lines: shipped with llmaccel, so it needs no download, and one window long, so one
check is a single short prefill.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

logger = logging.getLogger(__name__)

VALIDATION_TOKENS = 256


def validation_ids(tokenizer) -> list[int]:
    from llmaccel.data.prompts import builtin_prompts

    text = "\n\n".join(p.prompt for p in builtin_prompts())
    return tokenizer.encode(text, add_special_tokens=False)[:VALIDATION_TOKENS]


def validation_perplexity(engine, ids: list[int] | None = None) -> float:
    """Perplexity of the engine's model on the validation slice (one prefill; call between steps);
    `ids`: the slice already tokenized."""
    logprobs = engine.score(ids if ids is not None else validation_ids(engine.tokenizer))
    return math.exp(-sum(logprobs) / len(logprobs))


def reference_perplexity(engine) -> float | None:
    """The float model's perplexity on the validation slice: stored by `llmaccel quantize`, measured
    here once (on a second, float copy of the model, built and dropped) for a model quantized at load,
    and None for a float model (its own first measurement is the reference)."""
    from llmaccel.quantization.prequantized import read_quantization_config

    saved = read_quantization_config(engine.hf_dir)
    if saved is not None:
        return saved.get("reference_perplexity")
    float_engine = engine.float_copy(VALIDATION_TOKENS // engine.config.cache.block_size + 1)
    return validation_perplexity(float_engine) if float_engine is not None else None


class QualityWatch:
    """The server's background task: measure the validation perplexity and report it with the reference."""

    def __init__(self, report: Callable[[float, float], None]) -> None:
        self.report = report
        self.reference: float | None = None
        self._reference_known = False
        self._ids: list[int] | None = None  # the slice, tokenized at the first check

    def __call__(self, engine) -> None:
        if not self._reference_known:
            self.reference, self._reference_known = reference_perplexity(engine), True
        if self._ids is None:
            self._ids = validation_ids(engine.tokenizer)
        measured = validation_perplexity(engine, self._ids)
        if self.reference is None:
            self.reference = measured
        self.report(measured, self.reference)
        logger.info("quality check: validation perplexity %.4f (reference %.4f, %+.2f%%)", measured, self.reference,
                    (measured / self.reference - 1) * 100)
