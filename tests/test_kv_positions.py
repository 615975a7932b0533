"""Re-indexed attention sinks (--kv-positions cache, StreamingLLM): once the window has freed blocks, a
sequence's sink entries are private copies of its sink blocks with the keys turned by the freed positions, so
every key sits at its index in the cache. Checked against a reference computed by hand: a one-layer model's
logits depend only on the keys and values its query sees and their positions, so HF transformers run on exactly
the tokens the cache holds, at their cache indices (or at their text positions, for the absolute form), must
give the engine's log-probabilities."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

from llmaccel.config import SchedulerConfig
from llmaccel.engine.kv_cache_manager import KVCacheManager
from llmaccel.engine.request import Request
from llmaccel.engine.scheduler import Scheduler
from llmaccel.llm import LLM
from llmaccel.sampling_params import SamplingParams
from tests.tiny_models import make_long_llama

WINDOW, SINKS, BLOCK = 32, 4, 16  # one sink block (tokens 0..15)


def test_the_sink_block_is_copied_once_and_turned_again_each_time_the_window_frees_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=False, window=8, sinks=4,
                        reindex_sinks=True)
    turns = []
    kv.turn_sink_keys = lambda sources, targets, delta: turns.append((list(sources), list(targets), delta))
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv)
    request = Request("r", list(range(1, 7)), SamplingParams(max_tokens=40, ignore_eos=True))
    sched.add_request(request)
    tables = []
    while sched.has_unfinished:
        out = sched.schedule()
        sched.update(out, {s.request.request_id: [7] for s in out.scheduled if s.samples})
        tables.append((request.num_computed_tokens, list(request.block_ids), list(request.sink_block_ids),
                       request.num_skipped_blocks))
    # as with absolute positions block 1 goes at 16 computed tokens; sink block 0 is set aside and its turned
    # copy takes its place in the table, in the block just freed (1), rewritten at every later drop
    assert (12, [0, 1, 2], [], 0) in tables
    assert (16, [1, 2, 3], [0], 1) in tables
    assert (20, [1, 3, 4], [0], 2) in tables
    assert (44, [1, 3, 4], [0], 8) in tables
    assert turns == [([0], [1], 4 * skipped) for skipped in range(1, 9)]
    assert request.block_ids == request.sink_block_ids == [] and kv.num_free_blocks == 16


def test_a_request_admitted_past_the_window_on_a_cached_prefix_starts_with_a_turned_copy():
    kv = KVCacheManager(num_blocks=16, block_size=4, window=8, sinks=4, reindex_sinks=True)
    turns = []
    kv.turn_sink_keys = lambda sources, targets, delta: turns.append((list(sources), list(targets), delta))
    prompt = list(range(1, 30))
    first = Request("a", prompt, SamplingParams(max_tokens=1))
    kv.allocate_slots(first, 28)  # no window cut within one allocation: blocks 0..6
    first.num_computed_tokens = 28
    kv.cache_computed_blocks(first)
    kv.free(first)
    second = Request("b", prompt, SamplingParams(max_tokens=1))
    cached = kv.find_cached_prefix(second)
    assert cached.blocks == [0, 1, 2, 3, 4, 5, 6]
    new = kv.allocate_slots(second, 1, cached)
    # tokens 28.. see the window from token 20 (block 5): blocks 1..4 are skipped, and the sink block's copy is new
    assert second.num_skipped_blocks == 4 and second.sink_block_ids == [0]
    assert second.block_ids == [7, 5, 6, 8] and new == [8]
    assert turns == [([0], [7], 16)]


@pytest.fixture(scope="module")
def one_layer_dir(tmp_path_factory, tiny_tokenizer):
    return make_long_llama(tmp_path_factory.mktemp("one-layer") / "llama-1", tiny_tokenizer, num_layers=1, seed=77)


def _visible(query: int, step_start: int) -> list[int]:
    """The text positions a query sees in a step that started with `step_start` tokens computed: the sink
    block, and every block from the first one the window still needed when the step began."""
    skipped = max(0, max(0, step_start - WINDOW) // BLOCK - 1)
    return list(range(min(BLOCK, query + 1))) + list(range(max(BLOCK, (1 + skipped) * BLOCK), query + 1))


def _by_hand(model, ids: list[int], query: int, step_start: int, form: str) -> float:
    """log p(ids[query + 1]) from HF on just the tokens the cache holds, at their cache indices (form "cache") or
    their text positions ("absolute")."""
    seen = _visible(query, step_start)
    positions = list(range(len(seen))) if form == "cache" else seen
    with torch.no_grad():
        logits = model(torch.tensor([[ids[p] for p in seen]]), position_ids=torch.tensor([positions])).logits
    return torch.log_softmax(logits[0, -1].double(), -1)[ids[query + 1]].item()


@pytest.mark.parametrize("form", ["cache", "absolute"])
def test_decoding_matches_the_hand_computed_window(one_layer_dir, form):
    prompt = [(i * 7) % 300 + 5 for i in range(20)]
    llm = LLM(str(one_layer_dir), dtype="float32", kv_window=WINDOW, kv_sinks=SINKS, kv_positions=form)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=120, temperature=0.0,
                                                                        ignore_eos=True, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    ids = prompt + out.token_ids
    hf = LlamaForCausalLM.from_pretrained(one_layer_dir, torch_dtype=torch.float32).eval()
    other = "absolute" if form == "cache" else "cache"
    got, want, unlike = [], [], []
    for i, logprob in enumerate(out.logprobs):
        query = len(prompt) - 1 + i
        step_start = 0 if i == 0 else query  # the prompt runs in one step, then one token a step
        got.append(logprob.logprob)
        want.append(_by_hand(hf, ids, query, step_start, form))
        unlike.append(_by_hand(hf, ids, query, step_start, other))
    got, want, unlike = torch.tensor(got), torch.tensor(want), torch.tensor(unlike)
    assert (got - want).abs().max() < 2e-3
    assert (got[-40:] - unlike[-40:]).abs().max() > 2e-2  # far past the window the two forms part
    assert llm.engine.num_free_blocks == llm.engine.num_blocks


def test_windowed_scoring_matches_the_hand_computed_window(one_layer_dir):
    ids = [(i * 37) % 390 + 5 for i in range(200)]
    engine = LLM(str(one_layer_dir), dtype="float32", kv_window=WINDOW, kv_sinks=SINKS).engine
    got = torch.tensor(engine.score(ids))  # log p(ids[t + 1]), in window-long chunks
    hf = LlamaForCausalLM.from_pretrained(one_layer_dir, torch_dtype=torch.float32).eval()
    want = torch.tensor([_by_hand(hf, ids, t, t - t % WINDOW, "cache") for t in range(len(ids) - 1)])
    unlike = torch.tensor([_by_hand(hf, ids, t, t - t % WINDOW, "absolute") for t in range(150, len(ids) - 1)])
    assert (got - want).abs().max() < 2e-3
    assert (got[150:] - unlike).abs().max() > 2e-2


def test_an_int8_cache_turns_its_sinks_within_the_quantization_error(one_layer_dir):
    """The turned copy is dequantized, turned and quantized again: one more rounding of the sink keys."""
    ids = [(i * 37) % 390 + 5 for i in range(200)]
    engine = LLM(str(one_layer_dir), dtype="float32", kv_window=WINDOW, kv_sinks=SINKS, kv_cache_dtype="int8").engine
    got = torch.tensor(engine.score(ids))
    hf = LlamaForCausalLM.from_pretrained(one_layer_dir, torch_dtype=torch.float32).eval()
    want = torch.tensor([_by_hand(hf, ids, t, t - t % WINDOW, "cache") for t in range(len(ids) - 1)])
    error = (got - want).abs()
    assert error.max() < 0.1
    assert error[63:].mean() < 1.5 * error[:63].mean()  # turned sinks (from token 64 on) lose no more than INT8 does


def test_bad_position_settings_are_named_errors(one_layer_dir, tmp_path, tiny_tokenizer):
    with pytest.raises(ValueError, match="unknown kv_positions 'relative'"):
        LLM(str(one_layer_dir), kv_window=WINDOW, kv_positions="relative")
    with pytest.raises(ValueError, match="--kv-sinks 0: a model trained with full attention leans on its first"):
        LLM(str(one_layer_dir), kv_window=WINDOW, kv_sinks=0)
    with pytest.raises(ValueError, match="past the 4096 positions .* was trained for"):
        LLM(str(one_layer_dir), max_model_len=8192)
    # with a window the sequence may outrun the trained positions (re-indexed, no query sees past the window)
    assert LLM(str(one_layer_dir), kv_window=WINDOW, max_model_len=8192).engine.max_model_len == 8192
    config = GPT2Config(vocab_size=len(tiny_tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=256)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    tiny_tokenizer.save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="learned absolute positions, not RoPE"):
        LLM(str(tmp_path / "gpt2"), kv_window=WINDOW)
    LLM(str(tmp_path / "gpt2"), kv_window=WINDOW, kv_positions="absolute")  # the absolute form runs
