"""Per-client rate limits: a token bucket on requests and one on tokens, per client (an API key or an
address: server/auth.py decides).

Each bucket holds up to one minute's allowance and refills continuously. A request is admitted when
its client's request bucket has a whole request and its token bucket is not in debt; its prompt
tokens are taken at admission and its completion tokens when it ends, so a bucket may go negative
and the client then waits until it refills. Refusals say how long to wait (HTTP 429, Retry-After).
Clients are kept least recently seen first and the oldest are forgotten past `max_clients`, so
a flood of keys cannot grow memory without bound.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class TokenBucket:
    capacity: float
    per_second: float
    level: float
    updated: float

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.per_second)
        self.updated = now

    def wait_for(self, amount: float) -> float:
        """Seconds until the bucket holds `amount` (0 if it does now)."""
        return max(0.0, (amount - self.level) / self.per_second)


@dataclass(frozen=True)
class RateLimited:
    limit: str  # "requests" or "tokens"
    retry_after_s: float

    @property
    def retry_after_header(self) -> str:
        return str(max(1, math.ceil(self.retry_after_s)))


class RateLimiter:
    def __init__(self, requests_per_minute: int | None, tokens_per_minute: int | None, max_clients: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        for name, value in (("requests_per_minute", requests_per_minute), ("tokens_per_minute", tokens_per_minute)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.requests_per_minute = requests_per_minute
        self.tokens_per_minute = tokens_per_minute
        self.max_clients = max_clients
        self.clock = clock
        self._clients: OrderedDict[str, dict[str, TokenBucket]] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None

    def admit(self, client: str) -> RateLimited | None:
        """Take one request from the client's allowance, or say which limit refuses it and for how long."""
        refused = self.blocked(client)
        if refused is None and "requests" in self._clients[client]:
            self._clients[client]["requests"].level -= 1
        return refused

    def blocked(self, client: str) -> RateLimited | None:
        """What admit would refuse now, without taking anything."""
        buckets = self._buckets(client)
        requests, tokens = buckets.get("requests"), buckets.get("tokens")
        if tokens is not None and tokens.level < 0:
            return RateLimited("tokens", tokens.wait_for(0))
        if requests is not None and requests.level < 1:
            return RateLimited("requests", requests.wait_for(1))
        return None

    def charge(self, client: str, num_tokens: int) -> None:
        """Take `num_tokens` from the client's token allowance (it may go into debt)."""
        tokens = self._buckets(client).get("tokens")
        if tokens is not None:
            tokens.level -= num_tokens

    def _buckets(self, client: str) -> dict[str, TokenBucket]:
        now = self.clock()
        buckets = self._clients.get(client)
        if buckets is None:
            buckets = {name: TokenBucket(limit, limit / 60, limit, now)
                       for name, limit in (("requests", self.requests_per_minute), ("tokens", self.tokens_per_minute))
                       if limit is not None}
            self._clients[client] = buckets
            while len(self._clients) > self.max_clients:
                self._clients.popitem(last=False)
        else:
            self._clients.move_to_end(client)
        for bucket in buckets.values():
            bucket.refill(now)
        return buckets
