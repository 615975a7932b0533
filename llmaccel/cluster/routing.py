"""The routers by name, and their counters in this process, which the ingress's /metrics reads.

A handle's routers run in the process that owns the handle (the ingress). Ray ships a router class
by value, with a copy of its own module's globals, so the counters live here, in a module the
router imports by name.
"""

from __future__ import annotations

import threading
from collections import Counter


class RouterStats:
    """The routers' counters in this process, read by the ingress's /metrics (the routers of a
    handle run in the process that owns the handle)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.decisions: Counter[tuple[str, str]] = Counter()  # (router, why) -> requests
        self.matched_blocks = 0  # prompt blocks the chosen replica already held
        self.prompt_blocks = 0  # full prompt blocks routed
        self.retries = 0  # requests sent again after their replica died before answering

    def decided(self, router: str, why: str, matched: int = 0, blocks: int = 0) -> None:
        with self.lock:
            self.decisions[router, why] += 1
            self.matched_blocks += matched
            self.prompt_blocks += blocks


ROUTER_STATS = RouterStats()


def pick_replica(loads: dict[str, int], matches: dict[str, int], imbalance: int,
                 imbalance_ratio: float = 1.5) -> tuple[str, str]:
    """The cache-aware rule: (replica, why). A replica is too busy to claim a request when its load
    exceeds the lightest's by more than `imbalance` requests and by more than `imbalance_ratio` times
    (SGLang's router tests both thresholds the same way). Among the others, the one holding the most
    leading prompt blocks wins (ties: the lighter, then the name). If none of them holds any, the
    lightest ("balance" when a busier one held some, else "no_match"). The two thresholds keep a
    prefix every replica will share (a common system prompt) from drawing every new conversation to
    the first replica that cached it."""
    lightest = min(loads.values())
    balanced = [r for r in sorted(loads)
                if loads[r] - lightest <= imbalance or loads[r] <= imbalance_ratio * lightest]
    best = max(balanced, key=lambda r: (matches.get(r, 0), -loads[r]))
    if matches.get(best, 0):
        return best, "affinity"
    least = min(sorted(loads), key=lambda r: loads[r])
    return least, "balance" if any(matches.values()) else "no_match"


def with_shared_tier(matches: dict[str, int], shared: int, value: float) -> dict[str, float]:
    """Each replica's matched blocks with the blocks past them that a shared disk tier holds (`shared` leading blocks
    in all), each counted at `value` of a block in RAM: the measured saving of reading one against computing it."""
    return {name: held + value * max(0, shared - held) for name, held in matches.items()}


def shared_tier_value(stats: dict[str, dict], unmeasured: float = 0.5) -> float:
    """What the replicas measure a block on their shared tier to be worth (the median of those that have measured
    it; `unmeasured` while none has); 0 when they share no tier."""
    values = sorted(s["kv_tier_block_value"] for s in stats.values() if s.get("kv_tier_block_value") is not None)
    if values:
        return values[len(values) // 2]
    return unmeasured if any("kv_tier_block_value" in s for s in stats.values()) else 0.0


ROUTERS = {
    "cache-aware": "llmaccel.cluster.router:CacheAwareRouter",
    "round-robin": "llmaccel.cluster.router:RoundRobinRouter",
    "power-of-two": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
    "ray-prefix": "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:"
                  "PrefixCacheAffinityRouter",
}
