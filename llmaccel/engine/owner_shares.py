"""Fair share between owners (API keys) over time, for the priority policy (engine/priority_scheduling.py).

Within a step the priority scheduler already hands the token budget to owners in turn; over time an owner that
sends a tenth of another's load would still see its prompts wait in steps full of the other's rows. As in the
Virtual Token Counter of Sheng et al. ("Fairness in Serving Large Language Models", OSDI 2024), each owner's
service is counted in tokens computed for it; here the count decays with a half-life, so an owner cannot bank
credit for long, and an owner holding under half the mean service of the owners with requests in the engine is
*behind*: its requests rank ahead of the others' of the same priority (its prompt runs in a step of its own and
may stop the step in flight, model/step_interrupt.py). Owners with about equal loads are never behind, and with
one owner the policy is unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

BEHIND_FRACTION = 0.5  # behind: under this fraction of the mean service of the owners with requests
HALF_LIFE_S = 4.0  # how fast past service is forgotten


class OwnerShares:
    """Each owner's recent service in tokens, decayed with `half_life_s`."""

    def __init__(self, half_life_s: float = HALF_LIFE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.half_life_s = half_life_s
        self._clock = clock
        self._served: dict[str, float] = {}
        self._stamp = clock()

    def record(self, tokens: Mapping[str, int]) -> None:
        """Count the tokens a step computed for each owner (after decaying what was counted before)."""
        now = self._clock()
        decay = 0.5 ** ((now - self._stamp) / self.half_life_s)
        self._stamp = now
        served = {owner: count * decay for owner, count in self._served.items() if count * decay >= 0.5}
        for owner, count in tokens.items():
            served[owner] = served.get(owner, 0.0) + count
        self._served = served

    def served(self, owner: str) -> float:
        return self._served.get(owner, 0.0)

    def behind(self, active: Iterable[str]) -> frozenset[str]:
        """The owners among `active` (those with requests in the engine) holding under BEHIND_FRACTION of their
        mean service."""
        owners = set(active)
        if len(owners) < 2:
            return frozenset()
        mean = sum(self.served(owner) for owner in owners) / len(owners)
        return frozenset(owner for owner in owners if self.served(owner) < BEHIND_FRACTION * mean)
