"""Drafters: what proposes the tokens the target verifies. They know requests as token lists only.

- NgramDrafter copies the tokens that followed an earlier occurrence of the context's suffix.
- LookupFirstDrafter drafts by prompt lookup where the context repeats, by another drafter elsewhere.
- ModelDrafter runs a smaller model with the target's tokenizer (a distilled student) greedily, K
  passes a step. Its KV lives in a pool of its own laid out like the target's: the same block ids
  and slots, so the target's block tables, allocation, prefix cache, preemption and rollback serve
  both. Its KV is caught up lazily, when a request next drafts: the tokens since it last drafted (one
  or two in steady decoding; the prompt, as a chunk, the first time). Draft KV that went stale (a
  cached block computed while speculation was off) costs acceptance only: the target decides every
  token. Given a DraftVocabulary, its argmax runs over the frequent tokens only (spec/draft_vocab.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from llmaccel.batch_layout import Span
from llmaccel.engine.scheduler import ScheduledRequest
from llmaccel.runner import ModelRunner
from llmaccel.spec.draft_vocab import DraftVocabulary
from llmaccel.spec.ngram import propose_ngram

# catch-up spans up to this long run as decode rows (the draft's C++ decode stack), longer as a chunk
MAX_ROWS_SPAN = 16


class Drafter(Protocol):
    # False after a propose that caught a request's draft KV up over more than its last step's tokens
    # (its prompt, at its first draft): that step's time says little about speculation's steady cost
    steady: bool
    wants_features: bool  # whether `observe` should get the target's hidden states each step
    kv_slab: torch.Tensor | None  # its KV pool, laid out as the target's (the disk tier saves it too), if any

    def propose(self, items: list[ScheduledRequest]) -> dict[str, list[int]]:
        """Up to `num_draft_slots` tokens to follow each item's request's last token."""

    def forget(self, request_id: str) -> None:
        """The request finished or was preempted: drop what is kept for it."""

    def observe(self, features: dict[str, tuple[int, torch.Tensor]]) -> None:
        """The target's final hidden states of a step's rows (only when `wants_features`)."""

    def copy_kv_prefix(self, source: int, target: int, num_tokens: int) -> None:
        """A partial prefix-cache hit copies the target's KV slots: copy the draft's as well, if it has any."""


class NgramDrafter:
    steady = True
    wants_features = False
    kv_slab = None

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, items: list[ScheduledRequest]) -> dict[str, list[int]]:
        drafts = {}
        for item in items:
            tokens = propose_ngram(item.request.all_token_ids, item.num_draft_slots, self.min_n, self.max_n)
            if tokens:
                drafts[item.request.request_id] = tokens
        return drafts

    def forget(self, request_id: str) -> None:
        pass

    def observe(self, features: dict[str, tuple[int, torch.Tensor]]) -> None:
        pass

    def copy_kv_prefix(self, source: int, target: int, num_tokens: int) -> None:
        pass


class LookupFirstDrafter:
    """Prompt lookup where the context's suffix occurred before, `inner` (a draft model or head) for the
    rest. A small draft has no working copy circuit: where the answer repeats its prompt or itself,
    copying keeps most drafts and the draft few. `inner` catches up lazily on the requests it skipped."""

    def __init__(self, inner: Drafter, lookup: NgramDrafter) -> None:
        self.inner, self.lookup = inner, lookup
        self.wants_features = inner.wants_features

    @property
    def steady(self) -> bool:
        return self.inner.steady

    @property
    def kv_slab(self) -> torch.Tensor | None:
        return self.inner.kv_slab

    def propose(self, items: list[ScheduledRequest]) -> dict[str, list[int]]:
        drafts = self.lookup.propose(items)
        rest = [item for item in items if item.request.request_id not in drafts]
        self.inner.steady = True
        if rest:
            drafts.update(self.inner.propose(rest))
        return drafts

    def forget(self, request_id: str) -> None:
        self.inner.forget(request_id)

    def observe(self, features: dict[str, tuple[int, torch.Tensor]]) -> None:
        self.inner.observe(features)

    def copy_kv_prefix(self, source: int, target: int, num_tokens: int) -> None:
        self.inner.copy_kv_prefix(source, target, num_tokens)


class ModelDrafter:
    wants_features = False

    def __init__(self, runner: ModelRunner, vocabulary: DraftVocabulary | None = None) -> None:
        self.runner = runner
        self.vocabulary = vocabulary
        self._computed: dict[str, int] = {}  # request id -> positions whose draft KV is valid
        self.steady = True

    def copy_kv_prefix(self, source: int, target: int, num_tokens: int) -> None:
        self.runner.copy_kv_prefix(source, target, num_tokens)

    @property
    def kv_slab(self) -> torch.Tensor:
        return self.runner.kv_slab

    def propose(self, items: list[ScheduledRequest]) -> dict[str, list[int]]:
        if not items:
            return {}
        drafts: dict[str, list[int]] = {item.request.request_id: [] for item in items}
        spans = []
        for item in items:
            request = item.request
            known = self._computed.get(request.request_id)
            if known is None:  # first draft since admission: the prefix cache's blocks hold draft KV too
                known = request.num_cached_tokens if request.num_preemptions == 0 else 0
            start = min(known, request.num_tokens - 1)
            tokens = request.all_token_ids[start:]
            spans.append(Span(request, start, tokens, as_rows=len(tokens) <= MAX_ROWS_SPAN))
        # steady decoding catches up the last step's kept drafts and its own token: K + 1 at most
        self.steady = all(len(s.token_ids) <= item.num_draft_slots + 1 for s, item in zip(spans, items, strict=True))
        wanted = {item.request.request_id: item.num_draft_slots for item in items}
        for _ in range(max(wanted.values())):
            for span, token in zip(*self._next_tokens(spans), strict=True):
                drafts[span.request.request_id].append(token)
            spans = [Span(s.request, s.start + len(s.token_ids), [drafts[s.request.request_id][-1]], as_rows=True)
                     for s in spans if len(drafts[s.request.request_id]) < wanted[s.request.request_id]]
            if not spans:
                break
        for item in items:  # its KV now covers the last token and every draft but the last
            request = item.request
            self._computed[request.request_id] = request.num_tokens + len(drafts[request.request_id]) - 1
        return drafts

    @torch.inference_mode()
    def _next_tokens(self, spans: list[Span]) -> tuple[list[Span], list[int]]:
        """Run the spans; the draft's argmax after each one's last token (spans in the order run)."""
        hidden, ordered = self.runner.forward_spans(spans)
        return ordered, last_row_drafts(self.runner, self.vocabulary, hidden, ordered)[1]

    def forget(self, request_id: str) -> None:
        self._computed.pop(request_id, None)

    def observe(self, features: dict[str, tuple[int, torch.Tensor]]) -> None:
        pass


def last_row_drafts(runner: ModelRunner, vocabulary: DraftVocabulary | None, hidden: torch.Tensor,
                    ordered: list[Span]) -> tuple[torch.Tensor, list[int]]:
    """Each span's row at its last token ([spans, hidden], spans in the order run) and the draft's
    argmax there, over its vocabulary when cut."""
    ends, offset = [], 0
    for span in ordered:
        offset += len(span.token_ids)
        ends.append(offset - 1)
    if len(ends) < hidden.shape[0]:
        hidden = hidden[torch.tensor(ends, device=hidden.device)]
    if vocabulary is not None:
        return hidden, vocabulary.argmax(hidden)
    logits = runner.model.compute_logits(hidden)
    return hidden, logits[:, : runner.sampler.vocab_size].argmax(dim=-1).tolist()
