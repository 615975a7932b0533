"""Token-granular prefix reuse: a prompt that matches only the first tokens of a cached block copies
their KV into a block of its own. Exact block ids and copies on a tiny fake KV spec; exact token ids
against HF through the engine."""

from __future__ import annotations

import random

from llmaccel.engine.block_pool import PARTIAL
from llmaccel.engine.kv_cache_manager import CachedPrefix, KVCacheManager
from llmaccel.engine.request import Request
from llmaccel.llm import LLM
from llmaccel.sampling_params import SamplingParams
from tests.test_prefix_caching import _run_counting_tokens
from tests.tiny_models import hf_greedy


def _copying(num_blocks: int, block_size: int = 4, **kwargs) -> tuple[KVCacheManager, list[tuple[int, int, int]]]:
    kv = KVCacheManager(num_blocks, block_size, **kwargs)
    copies: list[tuple[int, int, int]] = []
    kv.copy_prefix = lambda source, target, count: copies.append((source, target, count))
    return kv, copies


def _request(token_ids: list[int], rid: str) -> Request:
    return Request(rid, token_ids, SamplingParams(max_tokens=8))


def _computed(kv: KVCacheManager, request: Request) -> Request:
    """Admit `request` on whatever it finds cached and mark its whole prompt computed, as a step would."""
    cached = kv.find_cached_prefix(request)
    assert kv.allocate_slots(request, request.num_tokens - cached.num_tokens(kv.block_size), cached) is not None
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed_blocks(request)
    return request


def test_a_prompt_matching_the_start_of_a_cached_block_copies_those_tokens():
    kv, copies = _copying(8)
    _computed(kv, _request(list(range(1, 13)), "a"))  # blocks 0 1 2, all full and cached
    b = _request(list(range(1, 11)) + [99], "b")  # tokens 1..10 shared: blocks 0 1 whole, block 2's first two
    cached = kv.find_cached_prefix(b)
    assert cached == CachedPrefix([0, 1], (2, 2)) and cached.num_tokens(4) == 10
    assert kv.allocate_slots(b, 1, cached) == [3]
    assert copies == [(2, 3, 2)]
    assert b.block_ids == [0, 1, 3] and b.num_computed_tokens == 10
    assert kv.pool.ref_counts[:4] == [2, 2, 1, 1]  # the source block is copied, not shared


def test_a_repeated_prompt_computes_only_its_last_token():
    kv, copies = _copying(8)
    _computed(kv, _request(list(range(1, 13)), "a"))
    again = _request(list(range(1, 13)), "b")
    cached = kv.find_cached_prefix(again)
    assert cached == CachedPrefix([0, 1], (2, 3))  # block 2 whole would leave nothing to compute
    assert kv.allocate_slots(again, 1, cached) == [3] and again.num_computed_tokens == 11
    assert copies == [(2, 3, 3)]


def test_the_longest_of_several_cached_continuations_is_copied():
    kv, copies = _copying(8)
    _computed(kv, _request([1, 2, 3, 4, 5, 6, 7, 8], "a"))  # block 1 = 5 6 7 8
    c = _computed(kv, _request([1, 2, 3, 4, 5, 6, 60, 70], "c"))  # its block 1 = 5 6 60 70 (5 6 copied)
    assert c.block_ids == [0, 2] and copies == [(1, 2, 2)]
    assert kv.pool.children[kv.pool.block_hashes[0]] == {1: (5, 6, 7, 8), 2: (5, 6, 60, 70)}
    d = _request([1, 2, 3, 4, 5, 6, 60, 71, 9], "d")
    assert kv.find_cached_prefix(d) == CachedPrefix([0], (2, 3))


def test_a_finished_requests_partly_computed_last_block_is_kept_for_the_next_turn():
    kv, copies = _copying(8)
    a = _computed(kv, _request(list(range(1, 11)), "a"))  # blocks 0 1 full, block 2 holds 9 10
    kv.free(a, keep_tail=True)
    assert kv.pool.block_hashes[2] == PARTIAL and kv.pool.free_block_ids()[-3:] == [2, 1, 0]
    turn = _request(list(range(1, 11)) + [11, 12, 13], "b")  # the whole last turn, then more
    cached = kv.find_cached_prefix(turn)
    assert cached == CachedPrefix([0, 1], (2, 2)) and cached.num_tokens(4) == 10
    assert kv.allocate_slots(turn, 3, cached) == [3, 4] and copies == [(2, 3, 2)]
    # a full-block lookup never finds a kept tail: it is indexed for partial matches only
    assert PARTIAL not in kv.pool.cached and sorted(kv.pool.cached.values()) == [0, 1]


def test_a_scoring_pass_keeps_no_tail_and_eviction_forgets_the_index():
    kv, _ = _copying(4)
    a = _computed(kv, _request(list(range(1, 11)), "a"))
    kv.free(a)  # keep_tail=False: a pass that may stop at a layer leaves no reusable KV
    assert kv.pool.block_hashes[2] is None
    b = _computed(kv, _request(list(range(1, 11)), "b"))
    kv.free(b, keep_tail=True)
    assert kv.pool.allocate(4) is not None  # every block handed out again: every index entry is gone
    assert kv.pool.children == {} and kv.pool.cached == {} and kv.pool.block_hashes == [None] * 4


def test_the_source_may_be_handed_out_by_the_same_allocation():
    """The copy runs before any forward pass, so a source block evicted by the allocation that takes
    its copy still holds its KV when copied."""
    kv, copies = _copying(4)
    a = _computed(kv, _request(list(range(1, 13)), "a"))
    kv.free(a, keep_tail=True)
    assert kv.pool.free_block_ids() == [3, 2, 1, 0]
    b = _request(list(range(1, 11)) + [99, 98, 97], "b")
    cached = kv.find_cached_prefix(b)
    assert cached == CachedPrefix([0, 1], (2, 2))
    assert kv.allocate_slots(b, 3, cached) == [3, 2]  # block 2 itself is taken as b's second new block
    assert copies == [(2, 3, 2)] and kv.pool.num_evictions == 1 and b.block_ids == [0, 1, 3, 2]


def test_whole_blocks_only_without_a_copy_hook_or_with_a_window():
    plain = KVCacheManager(8, 4)
    windowed, copies = _copying(8, window=8, sinks=4)
    for kv in (plain, windowed):
        _computed(kv, _request(list(range(1, 13)), "a"))
        assert kv.find_cached_prefix(_request(list(range(1, 11)) + [99], "b")).partial is None
    assert copies == []


# ---- through the engine (greedy, 12 tokens each) --------------------------------------------------


def test_a_repeated_prompt_and_the_next_turn_compute_only_their_new_tokens(llama_dir):
    llm = LLM(str(llama_dir), num_kv_blocks=64, block_size=16)
    rng = random.Random(3)
    prompt = [rng.randrange(3, 300) for _ in range(45)]
    first, computed = _run_counting_tokens(llm, prompt)
    assert computed == 45 + 11
    again, computed = _run_counting_tokens(llm, prompt)
    assert computed == 1 + 11  # 44 tokens from the cache: blocks 0 1 whole, block 2's first 12 copied
    # the next turn: the whole last exchange (45 + 11 computed tokens: block 3 holds 8), then 5 new tokens
    turn = prompt + first + [rng.randrange(3, 300) for _ in range(5)]
    nxt, computed = _run_counting_tokens(llm, turn)
    assert computed == (len(turn) - 56) + 11
    assert first == again == hf_greedy(llama_dir, prompt, 12)
    assert nxt == hf_greedy(llama_dir, turn, 12)
    assert llm.engine.prefix_cache_stats.hits == 44 + 56
    assert llm.engine.num_free_blocks == llm.engine.num_blocks


def test_partial_hits_under_a_tight_pool_match_the_uncached_engine(llama_dir):
    """Copies whose sources are evicted and reallocated in the same step, with preemption: the same tokens."""
    rng = random.Random(5)
    system = [rng.randrange(3, 300) for _ in range(21)]
    prompts = [system + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 9))] for _ in range(10)]
    prompts += [p[:len(p) - 1] for p in prompts[:4]] + prompts[:3]  # shorter and repeated: inside-block matches
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    plain = LLM(str(llama_dir), num_kv_blocks=40, block_size=4, enable_prefix_caching=False).generate(prompts, params)
    squeezed = LLM(str(llama_dir), num_kv_blocks=24, block_size=4)
    squeezed.generate(prompts[:2], params)
    cached = squeezed.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in plain]
    assert squeezed.engine.scheduler.num_preemptions > 0
    assert squeezed.engine.num_free_blocks == squeezed.engine.num_blocks
