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
from llmaccel.engine.scheduler import Scheduler, SchedulerOutput


def build_scheduler(config: SchedulerConfig, kv_cache: KVCacheManager) -> Scheduler:
    """The scheduler of `config.policy`."""
    return PriorityScheduler(config, kv_cache) if config.policy == "priority" else Scheduler(config, kv_cache)


def _rank(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time


class PriorityScheduler(Scheduler):
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        unscheduled = sorted(self.running, key=_rank)  # running requests not yet given tokens this step
        waiting = sorted(self.waiting, key=_rank)
        given: dict[str, int] = defaultdict(int)  # tokens of this step per owner
        in_flight: set[bytes] = set()
        admitting = True
        prefilling: int | None = None  # the best priority whose prompt is computed this step
        while budget > 0 and (unscheduled or (admitting and waiting)):
            candidates = [(r.priority, given[r.owner], 0, r.arrival_time, r) for r in _heads(unscheduled)]
            if admitting:
                candidates += [(r.priority, given[r.owner], 1, r.arrival_time, r) for r in _heads(waiting)]
            *_, request = min(candidates, key=lambda c: c[:4])
            if prefilling is not None and request.priority > prefilling:
                break  # a step that computes a prompt of better priority runs nothing worse: its first token is sooner
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
                computes = self.kv_cache.uncached_prefix_hashes(request, len(cached.blocks))
                if computes and computes[0] in in_flight:
                    continue  # it waits a step for that block (as in FCFS)
                num_cached_tokens = cached.num_tokens(self.kv_cache.block_size)
                num_new = self._chunk(request.num_tokens - num_cached_tokens, budget)
                while (len(self.running) >= self.max_num_seqs
                       or self.kv_cache.allocate_slots(request, num_new, cached) is None):
                    if not unscheduled or unscheduled[-1].priority <= request.priority:
                        admitting = False  # no one of worse priority to make room
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
                prefilling = request.priority if prefilling is None else min(prefilling, request.priority)
            given[request.owner] += scheduled.num_new_tokens + scheduled.num_draft_slots
            budget -= scheduled.num_new_tokens + scheduled.num_draft_slots
        return out


def _heads(requests: list[Request]) -> list[Request]:
    """The best-ranked request of each owner in a list sorted by rank."""
    heads: dict[str, Request] = {}
    for request in requests:
        heads.setdefault(request.owner, request)
    return list(heads.values())
