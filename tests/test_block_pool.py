"""Block pool and KV cache manager on a tiny fake KV spec: exact block ids and ref counts."""

from __future__ import annotations

import pytest

from llmaccel.engine.block_pool import BlockPool
from llmaccel.engine.kv_cache_manager import CachedPrefix, KVCacheManager
from llmaccel.engine.request import Request
from llmaccel.sampling_params import SamplingParams


def _request(num_tokens: int, rid: str = "r") -> Request:
    return Request(rid, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=8))


def test_allocation_takes_blocks_from_the_head_of_the_free_queue():
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.ref_counts == [1, 1, 1, 1, 1, 0]
    assert pool.num_free_blocks == 1


def test_allocation_that_cannot_be_met_takes_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    assert pool.allocate(2) is None
    assert pool.num_free_blocks == 1
    assert pool.free_block_ids() == [3]


def test_freed_blocks_go_to_the_head_and_are_reused_before_untouched_ones():
    pool = BlockPool(6)
    pool.allocate(4)  # 0 1 2 3
    pool.free([1, 0])
    assert pool.free_block_ids() == [1, 0, 4, 5]
    assert pool.allocate(3) == [1, 0, 4]
    assert pool.free_block_ids() == [5]
    pool.free([3])
    pool.free([2])
    assert pool.free_block_ids() == [2, 3, 5]  # the most recently freed first


def test_one_request_at_a_time_keeps_reusing_the_same_blocks():
    """The pool is mapped lazily: without prefix caching a long run of small requests must not touch
    the whole pool. (With it, cached blocks are kept, and the free pool serves as the cache.)"""
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    touched: set[int] = set()
    for i in range(50):
        request = Request(f"r{i}", [i] * 10, SamplingParams(max_tokens=8))
        kv.allocate_slots(request, 10)
        request.num_computed_tokens = 10
        kv.cache_computed_blocks(request)
        touched.update(request.block_ids)
        kv.free(request)
    assert touched == {0, 1, 2}


def test_a_block_is_free_only_when_its_last_reference_goes():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.ref_counts[block] += 1  # shared, as a cached prefix block would be
    pool.free([block])
    assert pool.ref_counts[block] == 1 and block not in pool.free_block_ids()
    pool.free([block])
    assert pool.ref_counts[block] == 0 and pool.free_block_ids()[0] == block


def test_freeing_a_free_block_is_an_error():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="block 1 freed more often than allocated"):
        pool.free([1])


def test_allocate_slots_adds_blocks_only_when_a_block_fills():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    request = _request(10)
    assert kv.allocate_slots(request, 10) == [0, 1, 2]
    request.num_computed_tokens = 10
    assert kv.allocate_slots(request, 2) == []  # tokens 11 and 12 still fit in block 2
    request.num_computed_tokens = 12
    assert kv.allocate_slots(request, 1) == [3]
    assert request.block_ids == [0, 1, 2, 3]


def test_allocate_slots_returns_none_when_the_pool_is_short():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    request = _request(9)
    assert kv.allocate_slots(request, 9) is None
    assert request.block_ids == [] and kv.num_free_blocks == 2


def test_free_releases_a_request_tail_first():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a, b = _request(8, "a"), _request(4, "b")
    kv.allocate_slots(a, 8)
    kv.allocate_slots(b, 4)
    kv.free(a)
    assert a.block_ids == []
    assert kv.pool.free_block_ids() == [1, 0, 3, 4, 5]
    assert kv.pool.ref_counts == [0, 0, 1, 0, 0, 0]


# ---- prefix caching ---------------------------------------------------------------------------------
def _computed(kv: KVCacheManager, request: Request, cached: CachedPrefix | None = None) -> Request:
    """Admit `request` (on a `cached` prefix) and mark its whole prompt computed, as a step would."""
    num_cached = cached.num_tokens(kv.block_size) if cached else 0
    assert kv.allocate_slots(request, request.num_tokens - num_cached, cached) is not None
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed_blocks(request)
    return request


def test_full_computed_blocks_are_hashed_and_a_new_request_reuses_the_longest_prefix():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _computed(kv, _request(10, "a"))  # blocks 0 1 full, block 2 partial
    assert a.block_ids == [0, 1, 2] and a.num_cached_blocks == 2
    assert [h is not None for h in kv.pool.block_hashes[:3]] == [True, True, False]
    b = Request("b", list(range(1, 9)) + [99, 98, 97], SamplingParams())  # shares tokens 1..8
    cached = kv.find_cached_prefix(b)
    assert cached.blocks == [0, 1]
    assert kv.allocate_slots(b, 3, cached) == [3]
    assert b.block_ids == [0, 1, 3] and b.num_computed_tokens == 8
    assert kv.pool.ref_counts[:4] == [2, 2, 1, 1]
    c = Request("c", list(range(1, 5)) + [50, 6, 7, 8], SamplingParams())  # differs inside block 1
    assert kv.find_cached_prefix(c).blocks == [0]


def test_a_fully_cached_prompt_still_computes_its_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    _computed(kv, _request(8, "a"))
    again = _request(8, "b")
    assert kv.find_cached_prefix(again).blocks == [0]  # block 1 would leave nothing to compute
    longer = _request(9, "c")
    assert kv.find_cached_prefix(longer).blocks == [0, 1]


def test_freed_cached_blocks_wait_at_the_tail_and_are_evicted_deepest_first():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = _computed(kv, _request(10, "a"))  # 0 1 hashed, 2 partial
    kv.free(a)
    # uncached block 2 goes to the head (reused first); cached 1 then 0 wait at the tail, 1 to be evicted first
    assert kv.pool.free_block_ids() == [2, 3, 4, 5, 1, 0]
    assert kv.pool.allocate(4) == [2, 3, 4, 5] and kv.pool.num_evictions == 0
    assert kv.pool.allocate(1) == [1] and kv.pool.num_evictions == 1
    assert kv.find_cached_prefix(_request(10, "b")).blocks == [0]  # block 0's prefix survives, block 1's is gone


def test_a_reused_block_leaves_the_free_queue_and_is_never_evicted_while_shared():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = _computed(kv, _request(9, "a"))  # 0 1 hashed, 2 partial
    kv.free(a)
    b = _request(9, "b")
    cached = kv.find_cached_prefix(b)
    assert cached.blocks == [0, 1]
    assert kv.allocate_slots(b, 1, cached) == [2]
    assert kv.pool.free_block_ids() == [3]
    assert kv.pool.allocate(2) is None  # blocks 0 and 1 are in use again: not evictable
    kv.free(b)
    assert kv.pool.ref_counts == [0, 0, 0, 0]


def test_an_allocation_that_cannot_be_met_takes_no_cached_block():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = _computed(kv, _request(8, "a"))
    kv.free(a)
    b = _request(20, "b")
    cached = kv.find_cached_prefix(b)
    assert cached.blocks == [0, 1]
    assert kv.allocate_slots(b, 12, cached) is None  # needs 3 more blocks, only 1 is free besides the cached 2
    assert b.block_ids == [] and b.num_computed_tokens == 0 and kv.pool.ref_counts == [0, 0, 0]


def test_the_salt_separates_model_variants_and_caching_can_be_turned_off():
    first, second = KVCacheManager(4, 4, cache_salt="m|int8"), KVCacheManager(4, 4, cache_salt="m|int4")
    a, b = _computed(first, _request(8, "a")), _computed(second, _request(8, "b"))
    assert first.pool.block_hashes[0] != second.pool.block_hashes[0]
    off = KVCacheManager(4, 4, enable_prefix_caching=False)
    c = _computed(off, _request(8, "c"))
    assert off.pool.block_hashes == [None] * 4 and off.find_cached_prefix(_request(8, "d")).blocks == []
    assert a.num_cached_blocks == b.num_cached_blocks == 2 and c.num_cached_blocks == 0
