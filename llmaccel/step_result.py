"""StepResult, what ModelRunner.execute (runner.py) returns, and the pieces that fill it from the step's
final hidden states: the sampled tokens (batched, each row alone if the batch raises), the drafts a
decode span keeps, prompt logprobs, and the hidden states a draft head reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmaccel.batch_layout import Span
from llmaccel.engine.guard_stage import Judgement
from llmaccel.model.causal_lm import CausalLM
from llmaccel.outputs import Logprob
from llmaccel.sampler import Sampler, SamplingRow
from llmaccel.spec.verify import accepted_greedy, accepted_sampled

PROMPT_LOGPROB_ROWS = 256  # prompt rows whose logits are taken at once: a long prompt's [rows, vocab] stays small

Sampled = tuple[int, Logprob | None, float | None]  # token, its logprobs (if asked), top probability (if asked)


@dataclass(frozen=True)
class StepResult:
    sampled: dict[str, list[Sampled]]  # request id -> the tokens it took this step, in order
    failed: dict[str, BaseException]  # request id -> why it could not sample
    # with `features`: request id -> (first position, the final hidden states of the rows it ran)
    features: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    # requests with prompt_logprobs: request id -> (first prompt position, the logprobs of its tokens there on)
    prompt_logprobs: dict[str, tuple[int, list[Logprob]]] = field(default_factory=dict)
    # with a semantic guard: request id -> its judgement, for each request whose prompt ended this step
    judged: dict[str, Judgement] = field(default_factory=dict)
    # embedding requests whose prompt ended this step: request id -> its pooled, L2-normalized vector
    embeddings: dict[str, list[float]] = field(default_factory=dict)


def sample_tokens(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow], confidence: bool
                  ) -> tuple[dict[int, Sampled], dict[int, BaseException]]:
    """One batched call, results by row; if it raises, each row alone from the same generator states,
    so the rows that do not raise get exactly the tokens the batch would have given them."""
    if not rows:
        return {}, {}
    states = [(r.generator, r.generator.get_state()) for r in rows if r.generator is not None]
    try:
        tokens, logprobs, top = sampler.sample(logits, rows, confidence)
        return {i: (tokens[i], logprobs[i], top[i] if top else None) for i in range(len(rows))}, {}
    except Exception:
        for generator, state in states:
            generator.set_state(state)
    sampled, failed = {}, {}
    for i, row in enumerate(rows):
        try:
            tokens, logprobs, top = sampler.sample(logits[i:i + 1], [row], confidence)
            sampled[i] = (tokens[0], logprobs[0], top[0] if top else None)
        except Exception as exc:
            failed[i] = exc
    return sampled, failed


def verify_drafts(sampler: Sampler, span: Span, logits: torch.Tensor, rows: list[SamplingRow],
                  results: list[Sampled]) -> list[Sampled]:
    """The tokens a decode span keeps of its drafts, and one more (spec/verify.py), with their
    logprobs and confidence from the row each was chosen at."""
    proposal = span.token_ids[1:]
    targets = [token for token, _, _ in results]
    if rows[0].params.greedy:
        return results[:len(accepted_greedy(targets, proposal))]
    probs = sampler.distribution(logits, rows)
    tokens = accepted_sampled(probs, proposal, targets[-1], rows[0].generator)
    kept = []
    for j, token in enumerate(tokens):
        sampled_token, logprob, top = results[j]
        if token != sampled_token and logprob is not None:  # the row drew another token: its own logprobs
            logprob = sampler.logprob(logits[j], token, rows[j].params.logprobs or 0)
        kept.append((token, logprob, top))
    return kept


def prompt_token_logprobs(model: CausalLM, sampler: Sampler, hidden: torch.Tensor, spans: list[Span]
                          ) -> dict[str, tuple[int, list[Logprob]]]:
    """For the requests that asked: the logprob of each prompt token these spans' rows predict (the row
    at position p predicts the token at p + 1), with the top N and its rank there."""
    out, offset = {}, 0
    for span in spans:
        request, count = span.request, len(span.token_ids)
        top_n = request.params.prompt_logprobs
        end = min(span.start + count, request.num_prompt_tokens - 1)  # rows that predict a prompt token
        if top_n is not None and span.start < end:
            items = []
            for lo in range(0, end - span.start, PROMPT_LOGPROB_ROWS):
                rows = hidden[offset + lo:offset + min(lo + PROMPT_LOGPROB_ROWS, end - span.start)]
                logits = model.compute_logits(rows)[:, :sampler.vocab_size].float()
                for j, row in enumerate(torch.log_softmax(logits, dim=-1)):
                    token = request.all_token_ids[span.start + lo + j + 1]
                    items.append(sampler.logprob_of(row, token, top_n, rank=True))
            out[request.request_id] = (span.start + 1, items)
        offset += count
    return out


def pool_embeddings(hidden: torch.Tensor, spans: list[Span], ending: set[str]) -> dict[str, list[float]]:
    """Fold each embedding request's rows of `hidden` into its pooled state (the sum for "mean", the last
    row for "last"; a prompt may run in several chunks), and give the normalized vector of those whose
    prompt ends this step (`ending`), in float32."""
    out, offset = {}, 0
    for span in spans:
        count, request = len(span.token_ids), span.request
        pooling = request.params.pooling
        if pooling is not None:
            rows = hidden[offset:offset + count].float()
            if pooling == "mean":
                request.pooled = rows.sum(0) if request.pooled is None else request.pooled + rows.sum(0)
            else:
                request.pooled = rows[-1].clone()  # the decode stack reuses its output buffer
            if request.request_id in ending:
                vector = request.pooled / request.num_prompt_tokens if pooling == "mean" else request.pooled
                out[request.request_id] = torch.nn.functional.normalize(vector, dim=0).tolist()
        offset += count
    return out


def span_features(hidden: torch.Tensor, spans: list[Span]) -> dict[str, tuple[int, torch.Tensor]]:
    """Each span's rows of `hidden`, views of one copy (the decode stack reuses its output buffer)."""
    out, offset, hidden = {}, 0, hidden.clone()
    for span in spans:
        count = len(span.token_ids)
        out[span.request.request_id] = (span.start, hidden[offset:offset + count])
        offset += count
    return out
