"""Greedy output token ids equal HF transformers' generate, whatever the batching does."""

from __future__ import annotations

import pytest

from llmaccel.llm import LLM
from llmaccel.sampling_params import SamplingParams
from tests.tiny_models import TINY_CONFIGS, hf_greedy

PROMPTS = [
    "The quick brown fox",
    "你好，世界！今天天气很好。",
    "What is the capital of France? The capital of France is Paris. Tell me a story about a dragon.",
    "A",
    "def hello():\n    print('hello world')",
    "Continuous batching packs every active request into each forward pass of the model. " * 3,
    "北京是中国的首都。",
    "numbers 0123456789",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _expected(model_dir, prompt_ids, max_tokens=24):
    return hf_greedy(model_dir, prompt_ids, max_tokens)


def _token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module", params=list(TINY_CONFIGS))
def model_case(request, tiny_model_dirs, tiny_tokenizer):
    model_dir = tiny_model_dirs[request.param]
    prompts = [tiny_tokenizer.encode(p) for p in PROMPTS]
    expected = [_expected(model_dir, p) for p in prompts]
    return model_dir, prompts, expected


def test_one_prompt(model_case):
    model_dir, prompts, expected = model_case
    llm = LLM(str(model_dir))
    assert _token_ids(llm.generate([prompts[2]], GREEDY)) == [expected[2]]


def test_eight_prompts_of_different_lengths_in_one_batch(model_case):
    model_dir, prompts, expected = model_case
    llm = LLM(str(model_dir))
    assert len({len(p) for p in prompts}) > 4
    assert _token_ids(llm.generate(prompts, GREEDY)) == expected


def test_chunked_prefill_with_a_16_token_budget(model_case):
    model_dir, prompts, expected = model_case
    llm = LLM(str(model_dir), max_num_batched_tokens=16)
    assert max(len(p) for p in prompts) > 16  # some prompt really is split into chunks
    assert _token_ids(llm.generate(prompts, GREEDY)) == expected


def test_preemption_with_a_pool_of_a_few_blocks(model_case):
    model_dir, prompts, expected = model_case
    llm = LLM(str(model_dir), num_kv_blocks=20, block_size=8)
    assert _token_ids(llm.generate(prompts, GREEDY)) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.num_free_blocks == 20


def test_requests_added_while_others_are_mid_decode(model_case):
    model_dir, prompts, expected = model_case
    engine = LLM(str(model_dir)).engine
    finished = {}
    for i in range(3):
        engine.add_request(f"early-{i}", prompts[i], GREEDY)
    for _ in range(6):
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    running = [r for r in engine.scheduler.running if r.num_output_tokens > 0]
    assert len(running) == 3  # the early ones are decoding now
    for i in range(3, 8):
        engine.add_request(f"late-{i}", prompts[i], GREEDY)
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    got = [finished[f"early-{i}" if i < 3 else f"late-{i}"].outputs[0].token_ids for i in range(8)]
    assert got == expected
