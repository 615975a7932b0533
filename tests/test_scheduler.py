"""The one token-budget rule, chunked prefill and preemption, on fake requests (no model)."""

from __future__ import annotations

import logging

from hypothesis import given, settings
from hypothesis import strategies as st

from llmaccel.config import SchedulerConfig
from llmaccel.engine.kv_cache_manager import KVCacheManager
from llmaccel.engine.request import Request, RequestStatus
from llmaccel.engine.scheduler import Scheduler
from llmaccel.sampling_params import SamplingParams


def _scheduler(num_blocks=16, block_size=4, max_num_seqs=8, max_tokens_per_step=64, prefix_caching=False,
               window=None):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching, window=window, sinks=4)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens_per_step), kv)


def _request(rid: str, prompt_len: int, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _step(scheduler: Scheduler, token: int = 7):
    out = scheduler.schedule()
    plan = [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]
    sampled = {s.request.request_id: [token] for s in out.scheduled if s.samples}
    scheduler.update(out, sampled)
    return plan, out


def test_budget_is_shared_and_a_long_prompt_is_chunked():
    sched = _scheduler(max_tokens_per_step=16)
    for rid in "abc":
        sched.add_request(_request(rid, 10))
    assert _step(sched)[0] == [("a", 10), ("b", 6)]
    assert _step(sched)[0] == [("a", 1), ("b", 4), ("c", 10)]
    assert _step(sched)[0] == [("a", 1), ("b", 1), ("c", 1)]


def test_decode_gives_every_running_request_one_token():
    sched = _scheduler()
    sched.add_request(_request("a", 3))
    sched.add_request(_request("b", 5))
    _step(sched)
    plan, _ = _step(sched)
    assert plan == [("a", 1), ("b", 1)]
    assert [r.num_output_tokens for r in sched.running] == [2, 2]


def test_max_num_seqs_caps_admission():
    sched = _scheduler(max_num_seqs=2)
    for rid in "abc":
        sched.add_request(_request(rid, 2))
    assert [rid for rid, _ in _step(sched)[0]] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_the_most_recently_admitted_request_is_preempted_and_requeued_first():
    sched = _scheduler(num_blocks=4, block_size=4)
    sched.add_request(_request("a", 7, max_tokens=8))
    sched.add_request(_request("b", 7, max_tokens=8))
    _step(sched)  # a: blocks [0, 1], b: [2, 3]; each has 8 tokens now (7 + 1 sampled)
    assert [r.block_ids for r in sched.running] == [[0, 1], [2, 3]]
    plan, out = _step(sched)  # a's 8th token fits; b's too
    assert plan == [("a", 1), ("b", 1)]
    plan, out = _step(sched)  # a needs a third block: b is preempted, its blocks go to a
    assert [r.request_id for r in out.preempted] == ["b"]
    assert plan == [("a", 1)]
    a = sched.running[0]
    assert a.block_ids == [0, 1, 3]
    b = sched.waiting[0]
    assert b.status is RequestStatus.PREEMPTED and b.block_ids == [] and b.num_computed_tokens == 0
    assert sched.kv_cache.pool.free_block_ids() == [2]


def test_a_preempted_request_recomputes_its_prompt_and_output(caplog):
    sched = _scheduler(num_blocks=4, block_size=4)
    sched.add_request(_request("a", 7, max_tokens=3))
    sched.add_request(_request("b", 7, max_tokens=8))
    with caplog.at_level(logging.WARNING, logger="llmaccel.engine.scheduler"):
        for _ in range(3):
            _step(sched)  # a finishes after 3 tokens; b was preempted on the way
    assert sched.num_preemptions == 1
    assert [r.getMessage() for r in caplog.records] == [
        "request b preempted: the KV cache is full, so it will recompute its 9 tokens (1 preemptions so far); "
        "raise --kv-cache-memory or lower --max-num-seqs"]
    plan, _ = _step(sched)
    assert plan == [("b", 9)]  # 7 prompt + 2 generated tokens come back in one chunk


def test_abort_frees_blocks_at_once():
    sched = _scheduler()
    sched.add_request(_request("a", 9))
    _step(sched)
    request = sched.running[0]
    assert sched.kv_cache.num_free_blocks == 13
    sched.finish_request(request, RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache.num_free_blocks == 16
    assert not sched.has_unfinished


operation = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12)),
    st.tuples(st.just("step"), st.just(0), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 50), st.just(0)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(operation, min_size=1, max_size=60), st.integers(1, 24), st.sampled_from([8, 16, 64]), st.booleans(),
       st.sampled_from([None, 8]))
def test_random_add_abort_finish_sequences_end_with_every_block_free(ops, token_budget, num_blocks, prefix_caching,
                                                                     window):
    """Every prompt is 1..n, so with prefix caching on they share prefixes and running requests share
    blocks; with a KV window, blocks are also freed from the middle of running sequences."""
    sched = _scheduler(num_blocks=num_blocks, block_size=4, max_num_seqs=4, max_tokens_per_step=token_budget,
                       prefix_caching=prefix_caching, window=window)
    pool = sched.kv_cache.pool
    capacity = num_blocks * 4
    live: list[Request] = []
    for i, (kind, a, b) in enumerate(ops):
        if kind == "add" and a + b <= capacity:
            request = _request(f"r{i}", a, max_tokens=b)
            live.append(request)
            sched.add_request(request)
        elif kind == "step":
            _step(sched, token=i)
        elif kind == "abort" and live:
            sched.finish_request(live[a % len(live)], RequestStatus.FINISHED_ABORTED)
        held = [blk for r in sched.running for blk in r.block_ids]
        assert all(held.count(blk) == pool.ref_counts[blk] for blk in set(held)), "a reference is lost"
        assert prefix_caching or len(held) == len(set(held)), "a block is owned twice"
        assert len(set(held)) + sched.kv_cache.num_free_blocks == num_blocks
        assert all(not r.block_ids for r in sched.waiting)
        hashed = {b: h for b, h in enumerate(pool.block_hashes) if h is not None}
        assert {pool.cached[h]: h for h in hashed.values()} == hashed, "the hash map and the blocks disagree"
    for _ in range(2000):  # run the rest to completion: nothing may get stuck
        if not sched.has_unfinished:
            break
        _step(sched)
    assert not sched.has_unfinished
    assert sched.kv_cache.num_free_blocks == num_blocks
    assert sorted(pool.free_block_ids()) == list(range(num_blocks))
    assert pool.ref_counts == [0] * num_blocks
    assert all(r.is_finished for r in live)
    assert sorted(pool.cached.values()) == sorted(b for b, h in enumerate(pool.block_hashes) if h is not None)


def test_a_request_waits_a_step_for_the_prompt_blocks_another_admitted_with_it_computes():
    """a and b share their first two blocks; c shares nothing. b would compute those blocks a second
    time in a's step, so it waits one step and starts on a's blocks; with prefix caching off nobody waits."""
    sched = _scheduler(prefix_caching=True)
    shared = list(range(1, 9))  # two full blocks of four
    a = Request("a", shared + [20, 21, 22], SamplingParams(max_tokens=4, ignore_eos=True))
    b = Request("b", shared + [30, 31], SamplingParams(max_tokens=4, ignore_eos=True))
    c = Request("c", [40, 41, 42, 43, 44], SamplingParams(max_tokens=4, ignore_eos=True))
    for r in (a, b, c):
        sched.add_request(r)
    plan, _ = _step(sched)
    assert plan == [("a", 11)] and [r.request_id for r in sched.waiting] == ["b", "c"]  # FIFO: c waits behind b
    assert a.block_ids == [0, 1, 2]
    plan, _ = _step(sched)
    assert plan == [("a", 1), ("b", 2), ("c", 5)]
    assert b.block_ids == [0, 1, 3] and b.num_cached_tokens == 8 and c.block_ids == [4, 5]
    assert sched.kv_cache.stats.hits == 8

    plain = _scheduler(prefix_caching=False)
    for rid, prompt in (("a", shared + [20, 21, 22]), ("b", shared + [30, 31])):
        plain.add_request(Request(rid, prompt, SamplingParams(max_tokens=4, ignore_eos=True)))
    assert _step(plain)[0] == [("a", 11), ("b", 10)]
