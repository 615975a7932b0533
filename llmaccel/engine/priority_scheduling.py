"""The priority policy (--scheduling-policy priority): the same token-budget rule as the FCFS scheduler, over the
running and waiting requests together in rank order.

A request's rank is its `priority` (lower first, vLLM's semantics), then whether its owner (an API key's client
id) is behind its fair share over the last seconds (engine/owner_shares.py): a behind owner's requests rank
ahead of the others' of the same priority. Each step walks the candidates best first: by rank; within a rank,
the owner that has been given the fewest of this step's tokens so far, so owners share the budget in turn; then
running before waiting, then arrival. A running request gets its next chunk, a waiting one is admitted. A step
that computes a prompt stops before any request of worse rank, so a better-ranked arrival's first token waits
for no worse-ranked decoding; and an arrival that outranks the worst row of the step in flight stops that step
at its next layer boundary (`outranks_step`, model/step_interrupt.py), so it does not wait for it either. When a
waiting request finds no sequence slot or no blocks, the running request of the worst rank not yet scheduled
this step, if worse than its own, is preempted for it (back to the queue, to be recomputed); when a running
request finds no block, the worst running request not yet scheduled is preempted, as FCFS preempts the newest.
With one owner and one priority the order is FCFS's.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

from llmaccel.config import SchedulerConfig
from llmaccel.engine.kv_cache_manager import KVCacheManager
from llmaccel.engine.owner_shares import OwnerShares
from llmaccel.engine.request import Request, RequestStatus
from llmaccel.engine.scheduler import Scheduler, SchedulerOutput

Rank = tuple[int, int]  # (priority, 0 when its owner is behind its fair share else 1): lower first
# A step stopped for fair share alone (the same priority) throws its work away: such stops are drawn from a bucket
# of FAIR_STOPS that refills at FAIR_STOPS_PER_S, so a stream of arrivals from new keys (each behind at first)
# cannot stop every step (at most ~2 steps' partial work a second), while a light key's few clients, which tend
# to arrive together, each still stop one. Stops for a better priority are not limited.
FAIR_STOPS = 2
FAIR_STOPS_PER_S = 2.0


def build_scheduler(config: SchedulerConfig, kv_cache: KVCacheManager) -> Scheduler:
    """The scheduler of `config.policy`."""
    return PriorityScheduler(config, kv_cache) if config.policy == "priority" else Scheduler(config, kv_cache)


class PriorityScheduler(Scheduler):
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(config, kv_cache)
        self.shares = OwnerShares(clock=clock)
        self._clock = clock
        self._fair_stops, self._fair_stops_at = float(FAIR_STOPS), clock()  # the bucket, and when it was filled
        # read by the server's thread at each arrival (outranks_step): replaced whole, never changed in place
        self._step_worst: Rank | None = None  # the worst rank in the step in flight
        self._ahead: frozenset[str] = frozenset()  # owners with requests that are not behind their share

    def outranks_step(self, priority: int, owner: str) -> bool:
        """Whether a request arriving now ranks ahead of a row of the step in flight (so that step should stop):
        by priority always, by fair share alone while the bucket of FAIR_STOPS holds one."""
        worst = self._step_worst
        if worst is None or (priority, int(owner in self._ahead)) >= worst:
            return False
        if priority < worst[0]:
            return True
        now = self._clock()
        self._fair_stops = min(FAIR_STOPS, self._fair_stops + (now - self._fair_stops_at) * FAIR_STOPS_PER_S)
        self._fair_stops_at = now
        if self._fair_stops < 1:
            return False
        self._fair_stops -= 1
        return True

    def schedule(self) -> SchedulerOutput:
        active = {r.owner for r in self.running} | {r.owner for r in self.waiting}
        behind = self.shares.behind(active)
        self._ahead = frozenset(active - behind)

        def rank(request: Request) -> Rank:
            return request.priority, int(request.owner not in behind)

        def order(request: Request) -> tuple[int, int, float]:
            return *rank(request), request.arrival_time

        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        unscheduled = sorted(self.running, key=order)  # running requests not yet given tokens this step
        waiting = sorted(self.waiting, key=order)
        given: dict[str, int] = defaultdict(int)  # tokens of this step per owner
        in_flight: set[bytes] = set()
        admitting = True
        prefilling: Rank | None = None  # the best rank whose prompt is computed this step
        while budget > 0 and (unscheduled or (admitting and waiting)):
            candidates = [(*rank(r), given[r.owner], 0, r.arrival_time, r) for r in _heads(unscheduled)]
            if admitting:
                candidates += [(*rank(r), given[r.owner], 1, r.arrival_time, r) for r in _heads(waiting)]
            *_, request = min(candidates, key=lambda c: c[:5])
            if prefilling is not None and rank(request) > prefilling:
                break  # a step that computes a prompt of better rank runs nothing worse: its first token is sooner
            if request.status is RequestStatus.RUNNING:
                unscheduled.remove(request)
                preempted = len(out.preempted)
                # short of blocks: the worst request not yet scheduled goes back, else this one
                scheduled = self._grant(request, budget, out,
                                        lambda this=request: unscheduled.pop() if unscheduled else this)
                admitting = admitting and len(out.preempted) == preempted  # memory is short: admit no one now
                if scheduled is None:
                    continue
            else:
                waiting.remove(request)
                cached = self.kv_cache.find_cached_prefix(request)
                if cached.loading:
                    continue  # its prefix is on the way from the disk tier
                computes = self.kv_cache.uncached_prefix_hashes(request, len(cached.blocks))
                if computes and computes[0] in in_flight:
                    continue  # it waits a step for that block (as in FCFS)
                num_cached_tokens = cached.num_tokens(self.kv_cache.block_size)
                num_new = self._chunk(request.num_tokens - num_cached_tokens, budget)
                while (len(self.running) >= self.max_num_seqs
                       or self.kv_cache.allocate_slots(request, num_new, cached) is None):
                    if not unscheduled or rank(unscheduled[-1]) <= rank(request):
                        admitting = False  # no one of worse rank to make room
                        break
                    victim = unscheduled.pop()
                    self.running.remove(victim)
                    self._preempt(victim, for_priority=True)
                    out.preempted.append(victim)
                    cached = self.kv_cache.find_cached_prefix(request)  # the victim's blocks may have held its prefix
                    num_cached_tokens = cached.num_tokens(self.kv_cache.block_size)
                    num_new = self._chunk(request.num_tokens - num_cached_tokens, budget)
                if not admitting:
                    continue
                in_flight.update(computes)
                self._admit(request, num_new, num_cached_tokens, out)
                scheduled = out.scheduled[-1]
            if not request.output_token_ids:  # it computes (part of) its prompt
                prefilling = rank(request) if prefilling is None else min(prefilling, rank(request))
            given[request.owner] += scheduled.num_slots
            budget -= scheduled.num_slots
        self._step_worst = max((rank(s.request) for s in out.scheduled), default=None)
        return out

    def update(self, output: SchedulerOutput, sampled: dict[str, list[int]],
               failed: dict[str, BaseException] | None = None) -> list[Request]:
        served: dict[str, int] = defaultdict(int)
        for item in output.scheduled:
            served[item.request.owner] += item.num_slots
        self.shares.record(served)
        return super().update(output, sampled, failed)


def _heads(requests: list[Request]) -> list[Request]:
    """The best-ranked request of each owner in a list sorted by rank."""
    heads: dict[str, Request] = {}
    for request in requests:
        heads.setdefault(request.owner, request)
    return list(heads.values())
