"""Which prefixes each replica holds: the hashes of its prefix cache's blocks, published to one actor.

A replica's BlockPool logs every block hash it caches or evicts (`record_events`). The replica
publishes those changes, with its load, to the ClusterState actor every PUBLISH_INTERVAL_S; each
router pulls the changes since its cursor. The hashes are the engine's own chained sha256 hashes
(cut to 64 bits), so a router that hashes a prompt's blocks the same way knows, not guesses, how
many of them a replica holds (the approach of llm-d's and Dynamo's KV events; Ray's own
PrefixCacheAffinityRouter and SGLang's router keep a tree of the text they routed instead).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from llmaccel.engine.kv_cache_manager import block_hash

PUBLISH_INTERVAL_S = 0.1  # a replica sends its cache changes this often (when there are any)
STATS_INTERVAL_S = 1.0  # and its load at least this often
STALE_S = 10.0  # a replica silent this long is gone (its process died): its blocks and stats are dropped
STATE_ACTOR = "llmaccel-cluster-state"


def short_hash(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "little")


def prompt_block_hashes(root: bytes, token_ids: Sequence[int], block_size: int) -> list[int]:
    """The short chained hashes of the prompt's full blocks, as the replicas' caches name them."""
    hashes, parent = [], root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start:start + block_size])
        hashes.append(short_hash(parent))
    return hashes


class ClusterState:
    """The actor every replica publishes to and every router and ingress reads from.

    The block changes form one log; a reader passes the cursor it got last time and receives what
    came after it, or a whole snapshot when the log was compacted past its cursor."""

    def __init__(self, max_log: int = 20_000) -> None:
        self.max_log = max_log
        self._log: list[tuple[str, list[int], list[int]]] = []
        self._log_start = 0  # the cursor of self._log[0]
        self._blocks: dict[str, set[int]] = {}
        self._stats: dict[str, tuple[float, dict]] = {}
        self._swept = 0.0

    def publish(self, replica: str, stats: dict | None, stored: list[int], removed: list[int],
                reset: bool = False) -> None:
        now = time.monotonic()
        if reset:
            self._forget(replica)
        held = self._blocks.setdefault(replica, set())
        held.update(stored)
        held.difference_update(removed)
        previous = self._stats.get(replica, (now, {}))[1]
        self._stats[replica] = (now, stats if stats is not None else previous)
        if stored or removed or reset:
            self._log.append((replica, stored, removed) if not reset else (replica, stored, ["reset"]))
        self._drop_stale(now)
        if len(self._log) > self.max_log:
            cut = len(self._log) // 2
            del self._log[:cut]
            self._log_start += cut

    def changes(self, cursor: int) -> tuple[int, list | None, dict[str, list[int]] | None]:
        """(new cursor, the log entries after `cursor`, None) or (new cursor, None, a snapshot)."""
        end = self._log_start + len(self._log)
        if cursor < self._log_start:
            return end, None, {replica: list(held) for replica, held in self._blocks.items()}
        return end, self._log[cursor - self._log_start:], None

    def stats(self) -> dict[str, dict]:
        """Each live replica's latest load and counters."""
        self._drop_stale(time.monotonic())
        return {replica: stats for replica, (_, stats) in self._stats.items()}

    def forget(self, replica: str) -> None:
        self._forget(replica)
        self._log.append((replica, [], ["reset"]))

    def _forget(self, replica: str) -> None:
        self._blocks.pop(replica, None)
        self._stats.pop(replica, None)

    def _drop_stale(self, now: float) -> None:
        if now - self._swept < 1.0:  # a sweep visits every replica: once a second, not every publish
            return
        self._swept = now
        for replica in [r for r, (seen, _) in self._stats.items() if now - seen > STALE_S]:
            self.forget(replica)


class BlockView:
    """A router's copy of which replica holds which block hashes, kept current from ClusterState.

    Between pulls the router also records where it sent each prompt (`expect`): those blocks will
    be cached there once the prefill runs, and a request that follows closely (the next turn, a
    parallel request with the same system prompt) should go to the same place. An expectation the
    replica never confirms (the request was aborted, or evicted at once) lapses after EXPECT_S."""

    EXPECT_S = 30.0
    MAX_SHARED = 200_000  # block hashes remembered as on a shared disk tier (~20 MB), the oldest forgotten first

    def __init__(self) -> None:
        self.cursor = -1  # before the first pull: ask for a snapshot
        self.blocks: dict[str, set[int]] = {}
        self.expected: dict[str, dict[int, float]] = {}
        # replicas sharing a disk tier written through (--kv-offload-policy write-through): every block any of them
        # cached is in the tier, for any replica to read, after RAM has evicted it too
        self.shared_tier = False
        self.shared: dict[int, None] = {}

    def apply(self, cursor: int, entries: list | None, snapshot: dict[str, list[int]] | None) -> None:
        """Take one pull's answer. Routing tasks pull concurrently; an answer that ends no later
        than what the view already has is older news (replaying it would bring back evicted blocks)."""
        if snapshot is None and cursor <= self.cursor:
            return
        if snapshot is not None:
            self.blocks = {replica: set(held) for replica, held in snapshot.items()}
        for replica, stored, removed in entries or ():
            if removed == ["reset"]:  # the replica (re)started: forget it, then take what it sent
                self.blocks.pop(replica, None)
                self.expected.pop(replica, None)
                removed = []
            held = self.blocks.setdefault(replica, set())
            held.update(stored)
            held.difference_update(removed)
            if self.shared_tier:
                self._share(stored)
            expected = self.expected.get(replica)
            if expected:
                for h in stored:
                    expected.pop(h, None)
                for h in removed:
                    expected.pop(h, None)
        self.cursor = cursor

    def expect(self, replica: str, hashes: Iterable[int]) -> None:
        until = time.monotonic() + self.EXPECT_S
        expected = self.expected.setdefault(replica, {})
        if len(expected) > 100_000:  # lapsed expectations are dropped here, not on every lookup
            now = time.monotonic()
            for h in [h for h, t in expected.items() if t <= now]:
                del expected[h]
        held = self.blocks.get(replica, ())
        for h in hashes:
            if h not in held:
                expected[h] = until

    def matched(self, replica: str, hashes: Sequence[int]) -> int:
        """How many of the prompt's leading blocks the replica holds (or will hold)."""
        held = self.blocks.get(replica, set())
        expected = self.expected.get(replica, {})
        now = time.monotonic()
        count = 0
        for h in hashes:
            if h in held or expected.get(h, 0.0) > now:
                count += 1
            else:
                break
        return count

    def _share(self, stored: Iterable[int]) -> None:
        for h in stored:
            self.shared.pop(h, None)
            self.shared[h] = None
        while len(self.shared) > self.MAX_SHARED:
            del self.shared[next(iter(self.shared))]

    def matched_shared(self, hashes: Sequence[int]) -> int:
        """How many of the prompt's leading blocks the shared disk tier holds, as far as this view knows."""
        count = 0
        for h in hashes:
            if h not in self.shared:
                break
            count += 1
        return count

    def drop(self, replica: str) -> None:
        self.blocks.pop(replica, None)
        self.expected.pop(replica, None)
