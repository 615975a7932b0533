"""Prefix caching through the engine and the server: outputs are unchanged (token-identical to HF)
while a request that shares a cached prefix computes only the rest."""

from __future__ import annotations

import random

import httpx
import pytest
from transformers import AutoTokenizer

from llmaccel.llm import LLM
from llmaccel.sampling_params import SamplingParams
from tests.live_server import MODEL_NAME, live_server
from tests.tiny_models import FAMILIES, hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompts(vocab_size: int, prefix_len: int = 512, suffix_len: int = 20) -> list[list[int]]:
    rng = random.Random(0)
    prefix = [rng.randrange(3, vocab_size) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(3, vocab_size) for _ in range(suffix_len)] for _ in range(2)]


def _run_counting_tokens(llm: LLM, prompt: list[int]) -> tuple[list[int], int]:
    """Generate one prompt step by step; returns its tokens and the tokens the engine computed."""
    engine = llm.engine
    engine.add_request(None, prompt, GREEDY)
    computed, outputs = 0, []
    while engine.has_unfinished_requests():
        outputs += engine.step(emit_unfinished=False)
        computed += engine.last_step.num_tokens
    return list(outputs[0].outputs[0].token_ids), computed


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias", *FAMILIES])
def test_a_shared_512_token_prefix_is_computed_once_and_outputs_are_unchanged(tiny_model_dirs, name):
    model_dir = tiny_model_dirs[name]
    cached, plain = LLM(str(model_dir), num_kv_blocks=128), LLM(str(model_dir), num_kv_blocks=128,
                                                                 enable_prefix_caching=False)
    first, second = _prompts(cached.engine.spec.vocab_size)
    tokens_1, computed_1 = _run_counting_tokens(cached, first)
    tokens_2, computed_2 = _run_counting_tokens(cached, second)
    assert computed_1 == 532 + 11  # the whole prompt, then one token per decode step
    assert computed_2 == 20 + 11  # only the suffix: the 512-token prefix came from the cache
    stats = cached.engine.prefix_cache_stats
    assert (stats.queries, stats.hits) == (2 * 532, 512)
    assert tokens_1 == hf_greedy(model_dir, first, 12) == _run_counting_tokens(plain, first)[0]
    assert tokens_2 == hf_greedy(model_dir, second, 12) == _run_counting_tokens(plain, second)[0]
    assert plain.engine.prefix_cache_stats.hits == 0
    assert cached.engine.num_free_blocks == cached.engine.num_blocks


def test_batched_requests_with_shared_prefixes_under_preemption_match_the_uncached_engine(llama_dir):
    """Shared blocks are ref-counted: requests reusing them alongside preemption still match."""
    rng = random.Random(1)
    system = [rng.randrange(3, 300) for _ in range(40)]
    prompts = [system + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 30))] for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(llama_dir), num_kv_blocks=40, block_size=4, enable_prefix_caching=False).generate(prompts, params)
    squeezed = LLM(str(llama_dir), num_kv_blocks=40, block_size=4)
    first = squeezed.generate(prompts[:1], params)  # caches the system prompt
    cached = squeezed.generate(prompts, params)
    assert squeezed.engine.scheduler.num_preemptions > 0
    assert squeezed.engine.prefix_cache_stats.hits >= 7 * 40 // 4 * 4
    assert first[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in plain]
    assert squeezed.engine.num_free_blocks == squeezed.engine.num_blocks


def test_server_exports_prefix_cache_counters(llama_dir):
    prompt = "The same long system prompt, repeated for every request of an application. " * 4
    with live_server(llama_dir) as server:
        cached = []
        for suffix in ("First question?", "Second question?"):
            reply = httpx.post(server.url + "/v1/completions", json={
                "model": MODEL_NAME, "prompt": prompt + suffix, "max_tokens": 3, "temperature": 0}).json()
            assert reply["usage"]["completion_tokens"] == 3
            cached.append(reply["usage"]["prompt_tokens_details"]["cached_tokens"])
        metrics = httpx.get(server.url + "/metrics").text
        server.wait_idle()
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("llmaccel_prefix_cache_")}
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    first, second = (tokenizer.encode(prompt + suffix) for suffix in ("First question?", "Second question?"))
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert cached[0] == 0 and cached[1] == shared  # every token the two prompts share
    assert values["llmaccel_prefix_cache_hits_total"] == cached[1]
    assert values["llmaccel_prefix_cache_queries_total"] > values["llmaccel_prefix_cache_hits_total"]


def test_multiturn_benchmark_computes_less_prefill_with_caching_and_the_same_replies(llama_dir, capsys):
    from llmaccel.cli import main

    assert main(["bench", "multiturn", "--model", str(llama_dir), "--conversations", "3", "--turns", "3",
                 "--reply-tokens", "6", "--kv-cache-memory", "64MiB"]) == 0
    captured = capsys.readouterr()
    assert "replies identical with and without prefix caching: True" in captured.err
    rows = [line.split(" | ") for line in captured.out.splitlines() if line.startswith("| o")]
    (off_prompt, off_computed, off_hits), (on_prompt, on_computed, on_hits) = (
        (int(r[1]), int(r[2]), int(r[3])) for r in rows)
    assert off_prompt == on_prompt == off_computed and off_hits == 0
    assert on_computed == on_prompt - on_hits and on_hits > on_prompt // 3
