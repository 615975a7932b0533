"""StreamingLLM KV window: a sequence keeps its sink blocks and its last `window` tokens' blocks,
the blocks between are freed while it runs, and its KV block count stays bounded however long it
generates."""

from __future__ import annotations

import pytest
import torch

from llmaccel.config import SchedulerConfig
from llmaccel.engine.kv_cache_manager import KVCacheManager
from llmaccel.engine.request import Request
from llmaccel.engine.scheduler import Scheduler
from llmaccel.llm import LLM
from llmaccel.sampling_params import SamplingParams
from tests.tiny_models import hf_greedy, make_long_llama


def test_blocks_between_the_sinks_and_the_window_are_freed_as_the_window_passes():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=False, window=8, sinks=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv)
    request = Request("r", list(range(1, 7)), SamplingParams(max_tokens=40, ignore_eos=True))
    sched.add_request(request)
    tables = []
    while sched.has_unfinished:
        out = sched.schedule()
        assert all(s.num_new_tokens <= 8 for s in out.scheduled)  # chunks never exceed the window
        sched.update(out, {s.request.request_id: [7] for s in out.scheduled if s.samples})
        tables.append((request.num_computed_tokens, list(request.block_ids), request.num_skipped_blocks))
        assert len(request.block_ids) <= 1 + 2 + 1 or request.is_finished
    # 6 prompt tokens: blocks 0, 1. At 12 computed tokens the window (tokens 4..11) still needs block 1;
    # at 16, tokens 8.. need only blocks 2 on, so block 1 goes back to the pool and is reused next.
    assert tables[0] == (6, [0, 1], 0)
    assert (12, [0, 1, 2], 0) in tables
    assert (16, [0, 2, 3], 1) in tables
    assert (17, [0, 2, 3, 1], 1) in tables  # block 1, freed, comes back as the newest block
    assert request.block_ids == [] and kv.num_free_blocks == 16


@pytest.fixture(scope="module")
def long_context_dir(tmp_path_factory, tiny_tokenizer):
    return make_long_llama(tmp_path_factory.mktemp("long") / "llama-long", tiny_tokenizer, num_layers=2, seed=1234)


def test_a_3000_token_generation_holds_a_bounded_number_of_blocks(long_context_dir):
    llm = LLM(str(long_context_dir), kv_window=64, kv_sinks=4, num_kv_blocks=32)
    engine = llm.engine
    engine.add_request("long", list(range(5, 15)), SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True))
    most, outputs = 0, []
    while engine.has_unfinished_requests():
        outputs += engine.step(emit_unfinished=False)
        most = max(most, engine.num_blocks - engine.num_free_blocks)
    assert len(outputs[0].outputs[0].token_ids) == 3000
    # ceil((window + sinks) / block_size) + 1 = 6, and the sink block's turned copy (re-indexed positions)
    assert most <= -(-(64 + 4) // 16) + 1 + 1
    assert engine.num_free_blocks == engine.num_blocks


def test_a_window_longer_than_the_sequence_changes_nothing(long_context_dir):
    prompt = list(range(5, 45))
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    windowed = LLM(str(long_context_dir), kv_window=128, kv_sinks=4).generate(prompt, params)[0]
    assert windowed.outputs[0].token_ids == hf_greedy(long_context_dir, prompt, 60)


def test_window_arguments_are_checked(long_context_dir):
    with pytest.raises(ValueError, match="kv_window must be at least the block size"):
        LLM(str(long_context_dir), kv_window=8)
    with pytest.raises(ValueError, match="needs up to 11 KV blocks per sequence"):
        LLM(str(long_context_dir), kv_window=64, num_kv_blocks=8)


def test_windowed_decoding_agrees_between_the_paged_kernel_and_the_torch_reference(long_context_dir):
    """Both attention paths read the same dense table of sink and window blocks."""
    prompt = list(range(5, 45))
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    kernel = LLM(str(long_context_dir), kv_window=32, kv_sinks=4)
    reference = LLM(str(long_context_dir), kv_window=32, kv_sinks=4, use_kernel=False)
    assert kernel.engine.runner.model.attention.uses_kernel and not reference.engine.runner.model.attention.uses_kernel
    assert kernel.generate(prompt, params)[0].outputs[0].token_ids == \
        reference.generate(prompt, params)[0].outputs[0].token_ids


def test_windowed_scoring_holds_few_blocks_and_matches_full_attention_in_its_first_window(long_context_dir):
    ids = [(i * 37) % 390 + 5 for i in range(600)]
    full = LLM(str(long_context_dir)).engine
    windowed = LLM(str(long_context_dir), kv_window=64, kv_sinks=4, num_kv_blocks=32).engine
    want, got = torch.tensor(full.score(ids)), torch.tensor(windowed.score(ids))
    assert full.last_score_blocks == 600 // 16 + 1
    assert windowed.last_score_blocks <= 1 + 2 * 4 + 1  # sinks, window, one window-long chunk
    assert got.shape == want.shape
    assert (got[:63] - want[:63]).abs().max() < 1e-4  # the first chunk sees everything before it
    assert (got[200:] - want[200:]).abs().max() > 1e-3  # later tokens no longer see the middle
    assert windowed.num_free_blocks == windowed.num_blocks
