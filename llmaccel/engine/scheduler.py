"""Scheduler: one token-budget rule for every request.

There is no prefill phase and no decode phase. Each request has `num_computed_tokens` and
`num_tokens`; each step first gives every running request its next tokens (1 when decoding, a
chunk when prefilling) within `max_num_batched_tokens`, then admits waiting requests while the
budget, `max_num_seqs` and free blocks last; a request admitted with a cached prefix (prefix
caching) starts past it, so only the rest counts against the budget. A request whose next prompt
block a request admitted in the same step is about to compute waits a step, then finds it cached
(SGLang's in-batch prefix caching): 64 chat requests that arrive together share their system
prompt's blocks instead of computing them 64 times. A request whose prefix is being read from the disk tier
(`--kv-offload-dir`) keeps its place while the requests behind it are admitted. When a running request cannot
get a block, the most recently admitted running request is preempted: its blocks are freed and it
goes back to the head of the queue, to be recomputed later. Chunked prefill falls out of this rule,
and so does speculative decoding: a decoding request asks for 1 + K slots, its last token and K
drafts the target verifies in the same pass (spec/); the slots of drafts it rejects are rolled back
by leaving `num_computed_tokens` before them, to be written over by the next step.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from llmaccel.config import SchedulerConfig
from llmaccel.engine.kv_cache_manager import KVCacheManager
from llmaccel.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)
PREEMPTION_WARNING_EVERY = 50  # warn at the first preemption, then at every 50th (as vLLM does)


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    num_draft_slots: int = 0  # decoding with speculation: slots for this many drafts after the new token

    @property
    def num_slots(self) -> int:
        """KV slots (and budget tokens) this step gives the request: its new tokens and its drafts."""
        return self.num_new_tokens + self.num_draft_slots

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the request's last token, so its logits give a new token."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_slots for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # speculative decoding: how many drafts a decoding request may have verified this step, given how
        # many requests are running (spec/policy.py); None: no speculation
        self.draft_slots: Callable[[Request, int], int] | None = None

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)
        if self.kv_cache.tier is not None:  # start reading its prefix from the disk tier while it queues
            self.kv_cache.find_cached_prefix(request)

    def outranks_step(self, priority: int, owner: str) -> bool:
        """Whether a request arriving now should stop the step in flight: never under FCFS (the priority policy's
        answer is in engine/priority_scheduling.py)."""
        return False

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            scheduled = self._grant(self.running[index], budget, out, lambda: self.running[-1])  # the newest
            if scheduled is None:
                break  # it preempted itself: everything after it is gone as well
            budget -= scheduled.num_slots
            index += 1

        # Admit waiting requests only in a step that preempted nobody: memory is short otherwise.
        in_flight: set[bytes] = set()  # prompt blocks the requests admitted in this step will compute
        for request in list(self.waiting):
            if out.preempted or budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            cached = self.kv_cache.find_cached_prefix(request)
            if cached.loading:
                continue  # its prefix is on the way from the disk tier: the requests behind it go first
            computes = self.kv_cache.uncached_prefix_hashes(request, len(cached.blocks))
            if computes and computes[0] in in_flight:
                break  # it waits a step for that block; the first admitted in any step never waits
            in_flight.update(computes)
            num_cached_tokens = cached.num_tokens(self.kv_cache.block_size)
            num_new = self._chunk(request.num_tokens - num_cached_tokens, budget)
            if self.kv_cache.allocate_slots(request, num_new, cached) is None:
                break
            self._admit(request, num_new, num_cached_tokens, out)
            budget -= num_new
        return out

    def _grant(self, request: Request, budget: int, out: SchedulerOutput,
               victim: Callable[[], Request]) -> ScheduledRequest | None:
        """Give a running request its next tokens (and draft slots) within `budget`. While the pool is short,
        drafts go first, then `victim()` (a running request, perhaps this one) is preempted. None when this one
        was."""
        remaining = request.num_tokens - request.num_computed_tokens
        num_new = self._chunk(remaining, budget)
        drafts = 0
        if remaining == 1 and self.draft_slots is not None:
            drafts = max(0, min(self.draft_slots(request, len(self.running)), budget - 1))
        while self.kv_cache.allocate_slots(request, num_new + drafts) is None:
            if drafts:  # short of blocks: drop the drafts before preempting anyone
                drafts = 0
                continue
            preempted = victim()
            self.running.remove(preempted)
            self._preempt(preempted)
            out.preempted.append(preempted)
            if preempted is request:
                return None
        scheduled = ScheduledRequest(request, num_new, drafts)
        out.scheduled.append(scheduled)
        return scheduled

    def _admit(self, request: Request, num_new: int, num_cached_tokens: int, out: SchedulerOutput) -> None:
        """A waiting request whose slots are allocated starts running with its first chunk."""
        self.kv_cache.record_admission(request, num_cached_tokens)
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        out.scheduled.append(ScheduledRequest(request, num_new))

    def _chunk(self, remaining: int, budget: int) -> int:
        limit = self.kv_cache.max_chunk
        return min(remaining, budget) if limit is None else min(remaining, budget, limit)

    def _preempt(self, request: Request, for_priority: bool = False) -> None:
        self.kv_cache.free(request, keep_tail=True)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.pooled = None  # an embedding request pools again from its first token
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        if for_priority:
            logger.info("request %s (priority %d) preempted for a request of higher priority; it will recompute its "
                        "%d tokens", request.request_id, request.priority, request.num_tokens)
        elif self.num_preemptions % PREEMPTION_WARNING_EVERY == 1:
            logger.warning("request %s preempted: the KV cache is full, so it will recompute its %d tokens "
                           "(%d preemptions so far); raise --kv-cache-memory or lower --max-num-seqs",
                           request.request_id, request.num_tokens, self.num_preemptions)

    def update(self, output: SchedulerOutput, sampled: dict[str, list[int]],
               failed: dict[str, BaseException] | None = None) -> list[Request]:
        """Advance each scheduled request by its chunk and append its new tokens, if any: one, or with
        speculation the drafts the target kept and one more (its KV is then computed up to the last of
        them; the rejected drafts' slots are left to be written over). Appending stops at a stop token.

        Returns the requests that received a token this step (finished ones included, already
        removed from the running list and with their blocks freed). A request whose update raises
        is left out and its error put in `failed` (when given; else the error propagates), so the
        caller can end it alone.
        """
        advanced = []
        for item in output.scheduled:
            request = item.request
            try:
                tokens = sampled.get(request.request_id)
                computed = request.num_computed_tokens + max(item.num_new_tokens, len(tokens or ()))
                for token in tokens or ():
                    request.append_output_token(token)
                    if request.check_stop_token():
                        break
                request.num_computed_tokens = min(computed, request.num_tokens - 1) if tokens else computed
                self.kv_cache.cache_computed_blocks(request)
                self.kv_cache.release_outside_window(request)
                if not tokens:
                    continue
                if request.is_finished:
                    self._remove(request)
            except Exception as exc:
                if failed is None:
                    raise
                failed[request.request_id] = exc
                continue
            advanced.append(request)
        return advanced

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """End a request from outside (stop string, abort): free its blocks at once."""
        if request.is_finished:
            return
        request.status = status
        self._remove(request)

    def _remove(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self.kv_cache.free(request, keep_tail=True)
