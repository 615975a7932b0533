"""Batched sampling: one call per step for every row that samples.

Order, as in vLLM: raw logprobs (if asked) -> penalties -> logit_bias -> min_tokens suppression ->
a grammar's mask (structured outputs) -> greedy rows take the argmax -> other rows: temperature,
top-k, top-p, min-p, then one draw by the inverse CDF: a uniform number u per row, and the first
token (in vocabulary order) at which the kept probabilities' running sum passes u times their total.
Rows with a seed draw u from their own generator, so what they sample does not depend on who else
is in the batch. On the CPU one C++ call does all of it for the batch (ops/csrc/sampling.cpp: no
sort of the vocabulary, no random number per token; 6-35x faster than the exponential race over a
sorted vocabulary it replaced, measured by a probe in the git history). The torch path below runs on other devices,
and the tests hold the two to the same token.

`distribution` gives the distribution a row's token is drawn from (a greedy row's at temperature 1),
by the same code; the output guard compares it with a reference. With `confidence`, `sample` also
returns that distribution's top probability per row.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

import torch

from llmaccel.ops.cpu_kernels import checked_kernels
from llmaccel.outputs import Logprob
from llmaccel.sampling_params import SamplingParams
from llmaccel.structured.compiler import unpack_masks


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    suppress_token_ids: tuple[int, ...] = ()  # EOS/stop ids while fewer than min_tokens were generated
    allowed: torch.Tensor | None = None  # a grammar's bitmask of the tokens allowed here, int32 [ceil(V / 32)]


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
        # without logprobs no one reads these logits raw again: the grammar masks may go onto them in place
        logits = self._adjust(logits, rows, masks_in_place=raw_logprobs is None)
        all_greedy = all(r.params.greedy for r in rows)  # known on the host: no device sync
        kernels = _kernels_for(logits)
        tokens = kernels.argmax_rows(logits) if kernels is not None else logits.argmax(dim=-1)
        top = None
        if confidence or not all_greedy:
            drawn, top_probs = self._draw(logits, rows)
            if not all_greedy:
                greedy = torch.tensor([r.params.greedy for r in rows], device=logits.device)
                tokens = torch.where(greedy, tokens, drawn.to(tokens.device))
            top = top_probs.tolist() if confidence else None
        token_list = tokens.tolist()

        logprobs: list[Logprob | None] = [None] * len(rows)
        if raw_logprobs is not None:
            for i, row in enumerate(rows):
                if want_logprobs[i]:
                    logprobs[i] = self.logprob_of(raw_logprobs[i], token_list[i], row.params.logprobs or 0)
        return token_list, logprobs, top

    @torch.inference_mode()
    def distribution(self, logits: torch.Tensor, rows: list[SamplingRow], truncate: bool = True) -> torch.Tensor:
        """[B, V] probabilities each row's next token is drawn from: penalties, suppression,
        temperature (1 for greedy rows) and, with `truncate`, top-k, top-p and min-p, renormalized."""
        probs = self._probs(self._adjust(logits[:, : self.vocab_size], rows), rows, truncate)
        return probs / probs.sum(dim=-1, keepdim=True)

    def _adjust(self, logits: torch.Tensor, rows: list[SamplingRow], masks_in_place: bool = False) -> torch.Tensor:
        """Penalties, logit_bias, min_tokens suppression and grammar masks (a new tensor when anything
        changes; with `masks_in_place`, masks alone go onto `logits` itself: a mask applied twice is the
        same, so a later pass over the same logits, such as a draft's verification, still sees the
        model's choice, but its raw logprobs are gone)."""
        owned = False
        if any(r.params.uses_penalties for r in rows):
            logits, owned = self._apply_penalties(logits.clone(), rows), True
        bias = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias if t < self.vocab_size]
        if bias:
            logits, owned = logits.clone(), True
            where, tokens, values = zip(*bias, strict=True)
            logits[list(where), list(tokens)] += torch.tensor(values, dtype=logits.dtype, device=logits.device)
        suppress = [(i, t) for i, r in enumerate(rows) for t in r.suppress_token_ids
                    if 0 <= t < self.vocab_size]
        if suppress:
            logits, owned = logits.clone(), True
            index = torch.tensor(suppress, device=logits.device)
            logits[index[:, 0], index[:, 1]] = float("-inf")
        constrained = [i for i, r in enumerate(rows) if r.allowed is not None]
        if constrained:
            target = logits if owned or masks_in_place else logits.clone()
            logits = apply_masks(target, constrained, torch.stack([rows[i].allowed for i in constrained]))
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

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row from its sampling distribution (greedy rows: at temperature 1), and that
        distribution's top probability."""
        uniform = _uniforms(rows)
        kernels = _kernels_for(logits)
        if kernels is not None:
            params = [(1.0 if r.params.greedy else r.params.temperature,
                       r.params.top_k if 0 < r.params.top_k < self.vocab_size else 0,  # any int is legal
                       r.params.top_p, r.params.min_p) for r in rows]
            temps, top_k, top_p, min_p = (torch.tensor(column) for column in zip(*params, strict=True))
            return tuple(kernels.sample_rows(logits, temps, top_k, top_p, min_p, uniform))
        return draw_reference(self._probs(logits, rows), uniform.to(logits.device))

    def logprob(self, logits: torch.Tensor, token: int, top_n: int) -> Logprob:
        """The raw logprobs of `token` (and the top `top_n`) under one row of logits, [V]."""
        return self.logprob_of(torch.log_softmax(logits[: self.vocab_size].float(), dim=-1), token, top_n)

    @staticmethod
    def logprob_of(row_logprobs: torch.Tensor, token: int, top_n: int, rank: bool = False) -> Logprob:
        """`token`'s entry in one row of log-softmaxed logits, with the top `top_n` (and, with `rank`,
        its rank there: 1 + the tokens more likely)."""
        top: dict[int, float] = {}
        if top_n > 0:
            values, indices = row_logprobs.topk(top_n)
            top = dict(zip(indices.tolist(), values.tolist(), strict=True))
        value = row_logprobs[token]
        place = int((row_logprobs > value).sum()) + 1 if rank else None
        return Logprob(token_id=token, logprob=float(value), top=top, rank=place)


def apply_masks(logits: torch.Tensor, rows: list[int], masks: torch.Tensor) -> torch.Tensor:
    """Grammar bitmasks (int32 [len(rows), words]) onto those rows of `logits`, in place: -inf where a
    token's bit is clear. The C++ kernel on the CPU, torch elsewhere."""
    kernels = mask_kernels() if _kernels_for(logits) is not None else None
    if kernels is not None:
        kernels.mask_rows_(logits, torch.tensor(rows, dtype=torch.long), masks)
        return logits
    allowed = unpack_masks(masks, logits.shape[-1]).to(logits.device)
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return logits


def _check_mask_kernel(kernels) -> str | None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 1000, generator=gen)
    masks = torch.randint(-2**31, 2**31 - 1, (3, 32), generator=gen, dtype=torch.int32)
    masks[0, :4], masks[1, 5:9] = 0, -1  # the fill and the skip
    want = logits.clone()
    want[[4, 0, 2]] = want[[4, 0, 2]].masked_fill(~unpack_masks(masks, 1000), float("-inf"))
    got = logits.clone()
    kernels.mask_rows_(got, torch.tensor([4, 0, 2]), masks)
    return None if torch.equal(got, want) else "mask_rows_"


@functools.cache
def mask_kernels() -> ModuleType | None:
    """The checked C++ grammar-mask kernel, or None (torch applies the masks then)."""
    return checked_kernels("mask_rows_", _check_mask_kernel, "grammar mask kernel")


def draw_reference(probs: torch.Tensor, uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse-CDF draw in torch: per row, the first token whose running sum of `probs` (in
    vocabulary order) passes uniform x the row's total; and the row's top probability."""
    cdf = probs.double().cumsum(dim=-1)
    target = (uniform.double() * cdf[:, -1])[:, None]
    tokens = torch.searchsorted(cdf, target, right=True).clamp(max=probs.shape[-1] - 1)[:, 0]
    return tokens, probs.max(dim=-1).values / probs.sum(dim=-1)


def _uniforms(rows: list[SamplingRow]) -> torch.Tensor:
    """float64 [B] in [0, 1): one number per row, from the row's generator when it has one."""
    uniform = torch.rand(len(rows), dtype=torch.float64)
    for i, row in enumerate(rows):
        if row.generator is not None:
            uniform[i] = torch.rand((), generator=row.generator, device=row.generator.device,
                                    dtype=torch.float64).item()
    return uniform


def _check_kernel(kernels) -> str | None:
    """None if the C++ draw picks the reference's token on random rows, else what failed."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=gen) * 3
    uniform = torch.rand(6, generator=gen, dtype=torch.float64)
    temps, top_k = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.5, 2.0]), torch.tensor([0, 40, 0, 5, 0, 300])
    top_p, min_p = torch.tensor([1.0, 1.0, 0.9, 0.8, 1.0, 0.95]), torch.tensor([0.0, 0.0, 0.0, 0.0, 0.1, 0.05])
    tokens, _ = kernels.sample_rows(logits, temps, top_k, top_p, min_p, uniform)
    tied = logits.clone()
    tied[2, 7], tied[4, 3] = tied[2].max(), float("nan")  # ties and NaN: the first index wins, as in torch
    if not torch.equal(kernels.argmax_rows(tied), tied.argmax(-1)):
        return "argmax_rows"
    rows = [SamplingRow(SamplingParams(temperature=float(t), top_k=int(k), top_p=float(p), min_p=float(m)), [], [],
                        None) for t, k, p, m in zip(temps, top_k, top_p, min_p, strict=True)]
    want, _ = draw_reference(Sampler(1000, torch.device("cpu"))._probs(logits, rows), uniform)
    return None if torch.equal(tokens, want) else "sample_rows"


@functools.cache
def sampling_kernels() -> ModuleType | None:
    """The checked C++ sampling kernel, or None (the torch path then samples)."""
    return checked_kernels("sample_rows", _check_kernel, "sampling kernel")


def _kernels_for(logits: torch.Tensor) -> ModuleType | None:
    """The C++ kernels where they can read these logits (float32 rows on the CPU, columns contiguous)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.stride(-1) != 1 or not logits.shape[-1]:
        return None
    return sampling_kernels()


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
