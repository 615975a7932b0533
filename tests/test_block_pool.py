"""Block pool and KV cache manager on a tiny fake KV spec: exact block ids and ref counts."""

from __future__ import annotations

import pytest

from llmaccel.engine.block_pool import BlockPool
from llmaccel.engine.kv_cache_manager import KVCacheManager
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
    """The pool is mapped lazily: a long run of small requests must not touch the whole pool."""
    kv = KVCacheManager(num_blocks=64, block_size=4)
    touched: set[int] = set()
    for i in range(50):
        request = _request(10, f"r{i}")
        kv.allocate_slots(request, 10)
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
