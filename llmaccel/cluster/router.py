"""Request routers for the engine replicas (Ray Serve's RequestRouter API).

CacheAwareRouter: a request goes to the replica that holds the longest run of its prompt's leading
KV blocks, among the replicas whose queue is not both `imbalance` requests and `imbalance_ratio` times
longer than the shortest, so one hot prefix does not pile onto one replica (SGLang's router and Ray's
PrefixCacheAffinityRouter fall back on load in the same way; routing.pick_replica is the rule).
Which blocks a replica holds it knows from the replicas' own cache events (kv_index.py), not from a
model of their caches. With no match anywhere, the shortest queue wins. Where the replicas share a disk tier written
through (--kv-offload-dir with --kv-offload-policy write-through), every block any of them cached is reachable from
all: each counts past what a replica holds in RAM at the value the replicas measure (routing.with_shared_tier), so a
busy holder of a prompt's prefix loses it to a lighter replica that will read it from disk.

RoundRobinRouter: the baseline that knows nothing, for `bench multiturn --replicas`.
"""

from __future__ import annotations

import itertools
import time
from collections import deque

import ray
from ray.serve.request_router import LocalityMixin, MultiplexMixin, PendingRequest, RequestRouter

from llmaccel.cluster import routing  # a module, not its objects: Ray pickles this module by value
from llmaccel.cluster.kv_index import STATE_ACTOR, BlockView


def _call_of(pending_request: PendingRequest | None):
    if pending_request is None or not pending_request.args:
        return None
    call = pending_request.args[0]
    return call if hasattr(call, "block_hashes") else None


class CacheAwareRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    # Not FIFOMixin: with it, a routing task hands its pick to whichever request waits longest, so a
    # replica chosen for one prompt's blocks serves another (measured: 1 in 6 turns misrouted).

    def initialize_state(self, imbalance: int = 8, imbalance_ratio: float = 1.5, pull_interval_s: float = 0.01,
                         namespace: str = "llmaccel") -> None:
        self.imbalance = imbalance
        self.imbalance_ratio = imbalance_ratio
        self.pull_interval_s = pull_interval_s
        self.view = BlockView()
        self._namespace = namespace
        self._state = None
        self._pulled = 0.0
        self._stats_pulled = 0.0
        self.shared_value = 0.0  # a shared disk tier's block against one in RAM (routing.shared_tier_value)
        # picks not yet sent: Ray's queue-length cache counts a request once it is sent, and a burst
        # of routing tasks would otherwise all see the same empty queues and pick the same replica
        self._unsent: dict[str, deque[float]] = {}

    async def _refresh(self) -> None:
        if time.monotonic() - self._pulled < self.pull_interval_s:
            return
        if self._state is None:
            self._state = ray.get_actor(STATE_ACTOR, namespace=self._namespace)
        cursor, entries, snapshot = await self._state.changes.remote(self.view.cursor)
        self.view.apply(cursor, entries, snapshot)
        self._pulled = time.monotonic()
        if self._pulled - self._stats_pulled >= self.STATS_INTERVAL_S:
            self._stats_pulled = self._pulled
            self.shared_value = routing.shared_tier_value(await self._state.stats.remote())
            self.view.shared_tier = self.shared_value > 0

    STATS_INTERVAL_S = 5.0  # how often the replicas' measurements (a shared tier's worth) are read

    UNSENT_S = 2.0  # a pick that was never sent (another replica took the request) lapses

    def _load(self, name: str, replica, now: float) -> int:
        queue_len = self._replica_queue_len_cache.get(replica.replica_id) or 0
        unsent = self._unsent.get(name)
        while unsent and now - unsent[0] > self.UNSENT_S:
            unsent.popleft()
        return queue_len + (len(unsent) if unsent else 0)

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        call = _call_of(pending_request)
        if call is None or not candidate_replicas:
            return [candidate_replicas]
        await self._refresh()
        now = time.monotonic()  # from here to the return nothing awaits: picks see each other
        by_name = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        loads = {name: self._load(name, r, now) for name, r in by_name.items()}
        hashes = call.block_hashes
        held = {name: self.view.matched(name, hashes) for name in by_name}
        shared = self.view.matched_shared(hashes) if self.shared_value else 0
        matches = routing.with_shared_tier(held, shared, self.shared_value) if shared else held
        best, why = routing.pick_replica(loads, matches, self.imbalance, self.imbalance_ratio)
        if shared > held[best]:
            why = "shared_tier"  # it reads what it lacks in RAM from the replicas' shared disk tier
        routing.ROUTER_STATS.decided("cache_aware", why, held[best], len(hashes))
        self.view.expect(best, hashes)
        self._unsent.setdefault(best, deque()).append(now)
        rest = sorted((n for n in by_name if n != best), key=lambda n: (-matches[n], loads[n]))
        return [[by_name[best]], [by_name[n] for n in rest]] if rest else [[by_name[best]]]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        unsent = self._unsent.get(replica_id.to_full_id_str())
        if unsent:
            unsent.popleft()  # sent: the queue-length cache counts it now

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.view.drop(replica_id.to_full_id_str())
        self._unsent.pop(replica_id.to_full_id_str(), None)

    def update_replicas(self, replicas) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.to_full_id_str() for r in replicas}
        for name in [n for n in self.view.blocks if n not in live]:
            self.view.drop(name)


class RoundRobinRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    def initialize_state(self, **_: object) -> None:
        self._turn = itertools.count()

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if not candidate_replicas:
            return [candidate_replicas]
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.to_full_id_str())
        start = next(self._turn) % len(ordered)
        ordered = ordered[start:] + ordered[:start]
        routing.ROUTER_STATS.decided("round_robin", "turn")
        return [[ordered[0]], ordered[1:]] if len(ordered) > 1 else [[ordered[0]]]
