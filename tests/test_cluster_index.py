"""The pieces of cache-aware routing that need no Ray: the pool's cache events, the hashes the
router computes, the state actor's log, a router's view of it, and the routing rule."""

from __future__ import annotations

import pytest

from llmaccel.cluster.kv_index import BlockView, ClusterState, prompt_block_hashes, short_hash
from llmaccel.cluster.routing import pick_replica, shared_tier_value, with_shared_tier
from llmaccel.engine.block_pool import BlockPool
from llmaccel.engine.kv_cache_manager import KVCacheManager
from llmaccel.engine.request import Request
from llmaccel.sampling_params import SamplingParams


def test_the_pool_logs_every_hash_it_caches_and_evicts_in_order():
    pool = BlockPool(4)
    events = pool.record_events()
    assert pool.allocate(2) == [0, 1]
    pool.cache_block(0, b"h0")
    pool.cache_block(1, b"h1")
    pool.cache_block(1, b"again")  # block 1 holds a prefix already: nothing changes, nothing logged
    pool.free([1, 0])  # cached blocks go to the tail in LRU order: free queue 2, 3, 1, 0
    assert pool.allocate(4) == [2, 3, 1, 0]
    assert list(events) == [(True, b"h0"), (True, b"h1"), (False, b"h1"), (False, b"h0")]


def test_recording_starts_with_what_the_cache_already_holds():
    pool = BlockPool(2)
    pool.allocate(1)
    pool.cache_block(0, b"old")
    assert list(pool.record_events()) == [(True, b"old")]
    assert BlockPool(2).events is None  # a single engine keeps no log


def test_the_router_hashes_a_prompt_exactly_as_the_engine_caches_it():
    kv = KVCacheManager(num_blocks=8, block_size=4, cache_salt="model|float32")
    events = kv.pool.record_events()
    prompt = list(range(100, 114))  # 3 full blocks and 2 tokens
    request = Request("r", prompt, SamplingParams(max_tokens=4))
    kv.allocate_slots(request, len(prompt))
    request.num_computed_tokens = len(prompt)
    kv.cache_computed_blocks(request)
    cached = [short_hash(h) for stored, h in events if stored]
    assert cached == prompt_block_hashes(kv.root_hash, prompt, 4)
    assert len(cached) == 3
    other = KVCacheManager(num_blocks=8, block_size=4, cache_salt="model|bfloat16")  # other weights: other hashes
    assert prompt_block_hashes(other.root_hash, prompt, 4) != cached


def test_a_reader_gets_the_changes_after_its_cursor_or_a_snapshot_when_the_log_moved_on():
    state = ClusterState(max_log=4)
    state.publish("a", {"running": 1}, [1, 2], [], reset=True)
    cursor, entries, snapshot = state.changes(0)
    assert (cursor, entries, snapshot) == (1, [("a", [1, 2], ["reset"])], None)
    state.publish("b", None, [7], [])
    state.publish("a", None, [3], [1])
    cursor, entries, snapshot = state.changes(1)
    assert (cursor, entries) == (3, [("b", [7], []), ("a", [3], [1])])
    for i in range(4):  # the log passes max_log: its first half is dropped
        state.publish("b", None, [10 + i], [])
    cursor, entries, snapshot = state.changes(1)
    assert entries is None and cursor == 7
    assert {r: sorted(h) for r, h in snapshot.items()} == {"a": [2, 3], "b": [7, 10, 11, 12, 13]}
    assert state.stats() == {"a": {"running": 1}, "b": {}}


def test_the_view_counts_leading_blocks_and_follows_evictions_and_resets():
    view = BlockView()
    view.apply(2, [("a", [9], []), ("a", [1, 2, 3], ["reset"]), ("b", [1], [])], None)
    assert view.blocks == {"a": {1, 2, 3}, "b": {1}}  # a reset forgets what came before it
    view.apply(4, [("a", [], [2])], None)
    assert view.matched("a", [1, 2, 3]) == 1  # block 2 was evicted: only the first block still counts
    assert view.matched("b", [1, 2, 3]) == 1
    assert view.matched("c", [1, 2, 3]) == 0
    view.expect("b", [1, 2, 3])  # routed there: the next request with that prefix should follow
    assert view.matched("b", [1, 2, 3, 4]) == 3
    view.apply(5, [("b", [], [3])], None)  # the replica evicted block 3 before the router pulled again
    assert view.matched("b", [1, 2, 3]) == 2
    view.apply(9, None, {"a": [5]})
    assert view.blocks == {"a": {5}} and view.cursor == 9
    view.apply(10, [("a", [], [5])], None)
    view.apply(8, [("a", [5], [])], None)  # an older pull answering late: ignored, block 5 stays evicted
    assert view.blocks == {"a": set()} and view.cursor == 10


def test_the_rule_prefers_the_holder_unless_it_is_too_busy():
    loads, matches = {"r1": 3, "r2": 0}, {"r1": 5, "r2": 0}
    assert pick_replica(loads, matches, imbalance=8) == ("r1", "affinity")
    assert pick_replica(loads, matches, imbalance=2) == ("r2", "balance")  # 3 > 0 + 2 and > 1.5 x 0: passed over
    busy = {"r1": 40, "r2": 30}  # 10 more, but not 1.5 times as many: the holder keeps it
    assert pick_replica(busy, {"r1": 5, "r2": 0}, imbalance=8) == ("r1", "affinity")
    assert pick_replica(busy, {"r1": 5, "r2": 0}, imbalance=8, imbalance_ratio=1.2) == ("r2", "balance")
    assert pick_replica({"r1": 1, "r2": 0}, {"r1": 0, "r2": 0}, 8) == ("r2", "no_match")
    assert pick_replica({"r1": 2, "r2": 2}, {"r1": 4, "r2": 4}, 8) == ("r1", "affinity")  # a tie: by name
    assert pick_replica({"r1": 2, "r2": 1}, {"r1": 4, "r2": 4}, 8) == ("r2", "affinity")  # a tie: the lighter
    assert pick_replica({"r1": 0, "r2": 6}, {"r1": 1, "r2": 3}, 8) == ("r2", "affinity")  # more blocks win


def test_a_shared_tier_makes_every_cached_block_reachable_at_its_measured_worth():
    view = BlockView()
    view.apply(1, [("a", [1, 2], [])], None)  # before the router knew of a shared tier: not counted as shared
    view.shared_tier = True
    view.apply(3, [("a", [3], []), ("b", [4], []), ("b", [], [4])], None)
    assert view.matched("b", [4]) == 0  # evicted from b's RAM ...
    assert view.matched_shared([3, 4, 5]) == 2  # ... but on the disk the replicas share
    assert view.matched_shared([1, 2, 3]) == 0
    matches = with_shared_tier({"a": 1, "b": 2, "c": 0}, 4, 0.9)
    assert matches == pytest.approx({"a": 1 + 0.9 * 3, "b": 2 + 0.9 * 2, "c": 0.9 * 4})
    busy = {"a": 0, "b": 20, "c": 1}  # b holds the most in RAM but is too busy; a holds one and reads three
    assert pick_replica(busy, matches, imbalance=8) == ("a", "affinity")  # a: 3.7 against c: 3.6
    assert shared_tier_value({"r1": {"kv_tier_block_value": 0.97}, "r2": {"kv_tier_block_value": 0.93},
                              "r3": {"kv_tier_block_value": 0.95}}) == 0.95
    assert shared_tier_value({"r1": {"kv_tier_block_value": None}}) == 0.5  # shared, not yet measured
    assert shared_tier_value({"r1": {"running": 2}}) == 0.0  # no shared tier


def test_the_shared_view_forgets_the_oldest_blocks_past_its_cap(monkeypatch):
    view = BlockView()
    monkeypatch.setattr(BlockView, "MAX_SHARED", 3)
    view.shared_tier = True
    view.apply(1, [("a", [1, 2, 3], [])], None)
    view.apply(2, [("b", [1, 4], [])], None)  # 1 again: the most recent now; 2 is the oldest
    assert list(view.shared) == [3, 1, 4]
