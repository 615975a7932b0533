"""The priority policy (--scheduling-policy priority): the same token-budget rule as the FCFS scheduler, over the
running and waiting requests together in priority order.

Each step walks the candidates best first: a lower `priority` first (vLLM's semantics); within a priority, the
owner (an API key's client id) that has been given the fewest of this step's tokens so far, so one key's flood
shares the budget with a lighter key instead of filling it; then running before waiting, then arrival. A running
request gets its next chunk, a waiting one is admitted. A step that computes a prompt stops before any request
of worse priority, so a high-priority arrival's first token waits for no low-priority decoding. When a waiting
request finds no sequence slot or no blocks, the running request of the worst priority not yet scheduled this
step, if worse than its own, is preempted for it (back to the queue, to be recomputed); when a running request
finds no block, the worst running request not yet scheduled is preempted, as FCFS preempts the newest. With one
owner and one priority the order is FCFS's.
"""

from __future__ import annotations

from collections import defaultdict

from llmaccel.config import SchedulerConfig
from llmaccel.engine.kv_cache_manager import KVCacheManager
from llmaccel.engine.request import Request, RequestStatus
from llmaccel.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput


def build_scheduler(config: SchedulerConfig, kv_cache: KVCacheManager) -> Scheduler:
    """The scheduler of `config.policy`."""
    return PriorityScheduler(config, kv_cache) if config.policy == "priority" else Scheduler(config, kv_cache)


def _rank(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time


class PriorityScheduler(Scheduler):
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        _schedule_by_priority(self, out)
        return out


def _schedule_by_priority(scheduler: Scheduler, out: SchedulerOutput) -> None:
    kv_cache, budget = scheduler.kv_cache, scheduler.max_num_batched_tokens
    unscheduled = sorted(scheduler.running, key=_rank)  # running requests not yet given tokens this step
    waiting = sorted(scheduler.waiting, key=_rank)
    given: dict[str, int] = defaultdict(int)  # tokens of this step per owner
    in_flight: set[bytes] = set()
    admitting = True

    def preempt_worst(worse_than: int | None) -> Request | None:
        """Preempt the unscheduled running request of the worst rank (only if its priority is worse than
        `worse_than`, where given)."""
        if not unscheduled or (worse_than is not None and unscheduled[-1].priority <= worse_than):
            return None
        victim = unscheduled.pop()
        scheduler.running.remove(victim)
        scheduler._preempt(victim, for_priority=worse_than is not None)
        out.preempted.append(victim)
        return victim

    prefilling: int | None = None  # the best priority whose prompt is computed this step
    while budget > 0 and (unscheduled or (admitting and waiting)):
        candidates = [(r.priority, given[r.owner], 0, r.arrival_time, r) for r in _heads(unscheduled)]
        if admitting:
            candidates += [(r.priority, given[r.owner], 1, r.arrival_time, r) for r in _heads(waiting)]
        *_, request = min(candidates, key=lambda c: c[:4])
        if prefilling is not None and request.priority > prefilling:
            break  # a step that computes a prompt of better priority runs nothing worse: its first token comes sooner
        if request.status is RequestStatus.RUNNING:
            unscheduled.remove(request)
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = scheduler._chunk(remaining, budget)
            drafts = 0
            if remaining == 1 and scheduler.draft_slots is not None:
                drafts = max(0, min(scheduler.draft_slots(request, len(scheduler.running)), budget - 1))
            while kv_cache.allocate_slots(request, num_new + drafts) is None:
                if drafts:
                    drafts = 0
                    continue
                admitting = False  # memory is short: admit no one this step
                if preempt_worst(None) is None:  # nothing left to take from: it goes back itself
                    scheduler.running.remove(request)
                    scheduler._preempt(request)
                    out.preempted.append(request)
                    break
            if request.status is not RequestStatus.RUNNING:
                continue
            out.scheduled.append(ScheduledRequest(request, num_new, drafts))
        else:
            waiting.remove(request)
            cached = kv_cache.find_cached_prefix(request)
            computes = kv_cache.uncached_prefix_hashes(request, len(cached.blocks))
            if computes and computes[0] in in_flight:
                continue  # it waits a step for that block (as in FCFS)
            num_cached_tokens = cached.num_tokens(kv_cache.block_size)
            num_new = scheduler._chunk(request.num_tokens - num_cached_tokens, budget)
            while (len(scheduler.running) >= scheduler.max_num_seqs
                   or kv_cache.allocate_slots(request, num_new, cached) is None):
                if preempt_worst(request.priority) is None:
                    admitting = False
                    break
                cached = kv_cache.find_cached_prefix(request)  # the victim's blocks may have held its prefix
                num_cached_tokens = cached.num_tokens(kv_cache.block_size)
                num_new = scheduler._chunk(request.num_tokens - num_cached_tokens, budget)
            if not admitting:
                continue
            in_flight.update(computes)
            kv_cache.record_admission(request, num_cached_tokens)
            scheduler.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            scheduler.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
        if not request.output_token_ids:  # it computes (part of) its prompt
            prefilling = request.priority if prefilling is None else min(prefilling, request.priority)
        given[request.owner] += out.scheduled[-1].num_new_tokens + out.scheduled[-1].num_draft_slots
        budget -= out.scheduled[-1].num_new_tokens + out.scheduled[-1].num_draft_slots


def _heads(requests: list[Request]) -> list[Request]:
    """The best-ranked request of each owner in a list sorted by rank."""
    heads: dict[str, Request] = {}
    for request in requests:
        heads.setdefault(request.owner, request)
    return list(heads.values())
