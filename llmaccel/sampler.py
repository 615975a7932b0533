"""Batched sampling: one call per step for every row that samples.

Order, as in vLLM: raw logprobs (if asked) -> penalties -> min_tokens suppression -> greedy rows
take the argmax -> other rows: temperature, top-k, top-p, min-p, then the exponential race
`argmax(p / q)` with q ~ Exp(1). Rows with a seed draw q from their own generator, so what they
sample does not depend on who else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmaccel.outputs import Logprob
from llmaccel.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    suppress_token_ids: tuple[int, ...] = ()  # EOS/stop ids while fewer than min_tokens were generated


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[Logprob | None]]:
        """logits: [B, V] float32. Returns the sampled token ids and, per row, logprobs or None."""
        logits = logits[:, : self.vocab_size]
        want_logprobs = [r.params.logprobs is not None for r in rows]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        if any(r.params.uses_penalties for r in rows):
            logits = self._apply_penalties(logits.clone(), rows)
        suppress = [(i, t) for i, r in enumerate(rows) for t in r.suppress_token_ids if t < self.vocab_size]
        if suppress:
            index = torch.tensor(suppress, device=logits.device)
            logits[index[:, 0], index[:, 1]] = float("-inf")

        greedy = torch.tensor([r.params.greedy for r in rows], device=logits.device)
        tokens = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            tokens = torch.where(greedy, tokens, self._random_sample(logits, rows))
        token_list = tokens.tolist()

        logprobs: list[Logprob | None] = [None] * len(rows)
        if raw_logprobs is not None:
            for i, row in enumerate(rows):
                if want_logprobs[i]:
                    logprobs[i] = self._logprob(raw_logprobs[i], token_list[i], row.params.logprobs or 0)
        return token_list, logprobs

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        batch, vocab = logits.shape
        device = logits.device
        counts = torch.zeros(batch, vocab, device=device)
        seen = torch.zeros(batch, vocab, dtype=torch.bool, device=device)
        for i, row in enumerate(rows):  # building index tensors; the math below is batched
            if row.output_token_ids:
                out = torch.tensor(row.output_token_ids, device=device)
                counts[i].index_add_(0, out, torch.ones(len(out), device=device))
            if row.params.repetition_penalty != 1 and row.prompt_token_ids:
                seen[i, torch.tensor(row.prompt_token_ids, device=device)] = True
        seen |= counts > 0
        rep = torch.tensor([r.params.repetition_penalty for r in rows], device=device)[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        freq = torch.tensor([r.params.frequency_penalty for r in rows], device=device)[:, None]
        pres = torch.tensor([r.params.presence_penalty for r in rows], device=device)[:, None]
        return logits - freq * counts - pres * (counts > 0).float()

    def _random_sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        device = logits.device
        temps = torch.tensor([r.params.temperature if not r.params.greedy else 1.0 for r in rows], device=device)
        logits = logits / temps[:, None]
        top_k = [r.params.top_k for r in rows]
        top_p = [r.params.top_p for r in rows]
        min_p = [r.params.min_p for r in rows]
        if any(k > 0 for k in top_k) or any(p < 1 for p in top_p):
            logits = _top_k_top_p(logits, torch.tensor(top_k, device=device), torch.tensor(top_p, device=device))
        probs = torch.softmax(logits, dim=-1)
        if any(p > 0 for p in min_p):
            threshold = torch.tensor(min_p, device=device)[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = torch.where(probs < threshold, torch.zeros_like(probs), probs)
        noise = torch.empty_like(probs)
        seeded = [i for i, r in enumerate(rows) if r.generator is not None]
        if len(seeded) < len(rows):
            noise.exponential_()
        for i in seeded:
            noise[i].exponential_(generator=rows[i].generator)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _logprob(row_logprobs: torch.Tensor, token: int, top_n: int) -> Logprob:
        top: dict[int, float] = {}
        if top_n > 0:
            values, indices = row_logprobs.topk(top_n)
            top = dict(zip(indices.tolist(), values.tolist(), strict=True))
        return Logprob(token_id=token, logprob=float(row_logprobs[token]), top=top)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus (the top token always stays)."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))[:, None]
    drop = ranks >= k
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    drop = before > top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
