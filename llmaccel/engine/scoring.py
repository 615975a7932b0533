"""Scoring whole token sequences outside the scheduler: perplexity, and the output guard's divergence.

A sequence is prefilled on KV blocks lent from the pool (one chunk, or window-long chunks with a KV
window, each seeing only what a long conversation would), and the blocks go back at once. Call
between engine steps.

`divergence` scores a finished continuation twice and returns the mean per-token
KL(served || reference), with the mean top probability of the distribution each token was drawn
from (the continuation's confidence). What is compared depends on what is served:
- a quantized variant: the served model against a full-precision copy, both with the request's
  penalties and temperature (a greedy request's at 1) but not truncated by top-k/top-p/min-p, so the
  KL measures what quantization changed, not what the sampling settings did;
- a float model: the distribution each token was drawn from (penalties, temperature, top-k, top-p,
  min-p) against the model's raw distribution, so the KL measures what the sampling settings did.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmaccel.engine.kv_cache_manager import KVCacheManager
from llmaccel.engine.request import Request
from llmaccel.runner import ModelRunner
from llmaccel.sampler import sampling_row
from llmaccel.sampling_params import SamplingParams

LOGIT_ROWS = 128  # logits are taken this many positions at a time, so [len, vocab] is never held


@dataclass(frozen=True)
class Divergence:
    mean_kl: float  # nats per token, KL(served || reference)
    max_kl: float
    mean_confidence: float  # mean top probability of the served distribution
    num_tokens: int


class SequenceScorer:
    def __init__(self, runner: ModelRunner, kv_cache: KVCacheManager) -> None:
        self.runner = runner
        self.kv_cache = kv_cache
        self.last_blocks = 0  # the most blocks the last call held

    def logprobs(self, token_ids: list[int]) -> list[float]:
        """log p(token | the tokens before it) for every token after the first."""
        out: list[float] = []
        self._run(token_ids, lambda request, count: out.extend(self.runner.chunk_logprobs(request, count).tolist()))
        return out

    def hidden_states(self, token_ids: list[int]) -> torch.Tensor:
        """The final hidden state at every position, [len, hidden]."""
        pieces: list[torch.Tensor] = []
        self._run(token_ids, lambda request, count: pieces.append(self.runner.chunk_hidden(request, count)))
        return torch.cat(pieces)

    def pooled_states(self, token_ids: list[int], layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean over positions, last position) of the residual stream after `layers`, [layers * hidden]
        each: a pass that stops at the last of them (the semantic guard's separate pass, and its training)."""
        total: torch.Tensor | None = None
        last: torch.Tensor | None = None

        def on_chunk(request: Request, count: int) -> None:
            nonlocal total, last
            rows = self.runner.chunk_taps(request, count, layers)
            total = rows.sum(0) if total is None else total + rows.sum(0)
            last = rows[-1]

        self._run(token_ids, on_chunk)
        return total / len(token_ids), last

    def _run(self, token_ids: list[int], on_chunk) -> None:
        request = Request("score", token_ids, SamplingParams(max_tokens=1))
        chunk = self.kv_cache.max_chunk or len(token_ids)
        self.last_blocks = 0
        try:
            while request.num_computed_tokens < len(token_ids):
                count = min(chunk, len(token_ids) - request.num_computed_tokens)
                if self.kv_cache.allocate_slots(request, count) is None:
                    raise RuntimeError("not enough free KV blocks to score this text now; retry when requests finish")
                self.last_blocks = max(self.last_blocks, len(request.block_ids) + len(request.sink_block_ids))
                on_chunk(request, count)
                request.num_computed_tokens += count
                self.kv_cache.release_outside_window(request)
        finally:
            self.kv_cache.free(request)


@torch.inference_mode()
def divergence(served: SequenceScorer, reference: SequenceScorer | None, prompt_ids: list[int],
               output_ids: list[int], params: SamplingParams, eos_token_ids: tuple[int, ...]) -> Divergence:
    """See the module docstring. `reference` None: the served model's raw distribution is the reference."""
    if not output_ids:
        return Divergence(0.0, 0.0, 1.0, 0)
    sequence = prompt_ids + output_ids[:-1]  # the position before each output token predicts it
    first = len(prompt_ids) - 1
    served_hidden = served.hidden_states(sequence)[first:]
    reference_hidden = reference.hidden_states(sequence)[first:] if reference is not None else None
    sampler, model = served.runner.sampler, served.runner.model
    kls, tops = [], []
    for start in range(0, len(output_ids), LOGIT_ROWS):
        end = min(start + LOGIT_ROWS, len(output_ids))
        logits = model.compute_logits(served_hidden[start:end])
        rows = [sampling_row(params, prompt_ids, output_ids[:j], eos_token_ids) for j in range(start, end)]
        drawn = sampler.distribution(logits, rows)
        if reference is None:
            q = drawn.double()
            p = torch.log_softmax(logits[:, : sampler.vocab_size].double(), dim=-1)
        else:
            q = sampler.distribution(logits, rows, truncate=False).double()
            p = torch.log(sampler.distribution(reference.runner.model.compute_logits(reference_hidden[start:end]),
                                               rows, truncate=False).double())
        terms = torch.where(q > 0, q * (torch.log(q) - p), torch.zeros_like(q))
        kls.append(terms.sum(dim=-1).clamp_min(0))
        tops.append(drawn.max(dim=-1).values.double())
    kl, top = torch.cat(kls), torch.cat(tops)
    return Divergence(float(kl.mean()), float(kl.max()), float(top.mean()), len(output_ids))
