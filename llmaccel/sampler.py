"""Batched sampling: one call per step for every row that samples.

Order, as in vLLM: raw logprobs (if asked) -> penalties -> min_tokens suppression -> greedy rows
take the argmax -> other rows: temperature, top-k, top-p, min-p, then the exponential race
`argmax(p / q)` with q ~ Exp(1). Rows with a seed draw q from their own generator, so what they
sample does not depend on who else is in the batch.

`distribution` gives the distribution a row's token is drawn from (a greedy row's at temperature 1),
by the same code; the output guard compares it with a reference. With `confidence`, `sample` also
returns that distribution's top probability per row.
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


def sampling_row(params: SamplingParams, prompt_token_ids: list[int], output_token_ids: list[int],
                 eos_token_ids: tuple[int, ...], generator: torch.Generator | None = None) -> SamplingRow:
    """The row for sampling the token after `output_token_ids` (EOS and stop ids suppressed while
    fewer than min_tokens were generated)."""
    suppress: tuple[int, ...] = ()
    if len(output_token_ids) < params.min_tokens:
        suppress = tuple(params.stop_token_ids) + (() if params.ignore_eos else eos_token_ids)
    return SamplingRow(params, prompt_token_ids, output_token_ids, generator, suppress)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: list[SamplingRow], confidence: bool = False
               ) -> tuple[list[int], list[Logprob | None], list[float] | None]:
        """logits: [B, V] float32. Returns the sampled token ids; per row, logprobs or None; and with
        `confidence`, the top probability of each row's sampling distribution."""
        logits = logits[:, : self.vocab_size]
        want_logprobs = [r.params.logprobs is not None for r in rows]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        logits = self._adjust(logits, rows)
        all_greedy = all(r.params.greedy for r in rows)  # known on the host: no device sync
        tokens = logits.argmax(dim=-1)
        probs = self._probs(logits, rows) if confidence or not all_greedy else None
        if not all_greedy:
            greedy = torch.tensor([r.params.greedy for r in rows], device=logits.device)
            tokens = torch.where(greedy, tokens, self._race(probs, rows))
        token_list = tokens.tolist()

        logprobs: list[Logprob | None] = [None] * len(rows)
        if raw_logprobs is not None:
            for i, row in enumerate(rows):
                if want_logprobs[i]:
                    logprobs[i] = self._logprob(raw_logprobs[i], token_list[i], row.params.logprobs or 0)
        top = (probs.max(dim=-1).values / probs.sum(dim=-1)).tolist() if confidence else None
        return token_list, logprobs, top

    @torch.inference_mode()
    def distribution(self, logits: torch.Tensor, rows: list[SamplingRow], truncate: bool = True) -> torch.Tensor:
        """[B, V] probabilities each row's next token is drawn from: penalties, suppression,
        temperature (1 for greedy rows) and, with `truncate`, top-k, top-p and min-p, renormalized."""
        probs = self._probs(self._adjust(logits[:, : self.vocab_size], rows), rows, truncate)
        return probs / probs.sum(dim=-1, keepdim=True)

    def _adjust(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Penalties and min_tokens suppression (a new tensor when anything changes)."""
        if any(r.params.uses_penalties for r in rows):
            logits = self._apply_penalties(logits.clone(), rows)
        suppress = [(i, t) for i, r in enumerate(rows) for t in r.suppress_token_ids
                    if 0 <= t < self.vocab_size]
        if suppress:
            logits = logits.clone()
            index = torch.tensor(suppress, device=logits.device)
            logits[index[:, 0], index[:, 1]] = float("-inf")
        return logits

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

    def _probs(self, logits: torch.Tensor, rows: list[SamplingRow], truncate: bool = True) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p: each row's (unnormalized after min-p) probabilities."""
        device = logits.device
        temps = torch.tensor([r.params.temperature if not r.params.greedy else 1.0 for r in rows], device=device)
        logits = logits / temps[:, None]
        if not truncate:
            return torch.softmax(logits, dim=-1)
        top_k = [r.params.top_k if r.params.top_k < self.vocab_size else 0 for r in rows]  # >= vocab: no limit
        top_p = [r.params.top_p for r in rows]
        min_p = [r.params.min_p for r in rows]
        if any(k > 0 for k in top_k) or any(p < 1 for p in top_p):
            logits = _top_k_top_p(logits, torch.tensor(top_k, device=device), torch.tensor(top_p, device=device))
        probs = torch.softmax(logits, dim=-1)
        if any(p > 0 for p in min_p):
            threshold = torch.tensor(min_p, device=device)[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = torch.where(probs < threshold, torch.zeros_like(probs), probs)
        return probs

    def _race(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """One draw per row from `probs`: argmax(p / q), q ~ Exp(1), from the row's generator if seeded."""
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
