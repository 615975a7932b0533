"""Engine sizing: KV capacity, the context window it implies, and other architectures of the family."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from llmaccel.config import parse_memory_size
from llmaccel.errors import InvalidRequestError
from llmaccel.llm import LLM
from llmaccel.sampling_params import SamplingParams
from tests.tiny_models import hf_greedy


def test_memory_sizes_parse_with_units():
    assert parse_memory_size("1GiB") == 1 << 30
    assert parse_memory_size("512MiB") == 512 << 20
    assert parse_memory_size("2g") == 2 << 30
    assert parse_memory_size("1.5 GB") == 1_500_000_000
    assert parse_memory_size("4096") == 4096


def test_capacity_is_logged_and_caps_the_context_window(llama_dir, caplog):
    with caplog.at_level(logging.INFO, logger="llmaccel"):
        llm = LLM(str(llama_dir), num_kv_blocks=4, block_size=8)
    assert "KV cache: 4 blocks x 8 tokens = 32 tokens of capacity" in caplog.text
    assert llm.engine.max_model_len == 32
    with pytest.raises(InvalidRequestError, match="max_model_len is 32"):
        llm.generate([[5] * 40], SamplingParams(max_tokens=1))


def test_kv_memory_budget_sets_the_number_of_blocks(llama_dir):
    # tiny llama-gqa: 2 layers x 2 kv heads x 16 dims x K and V x 4 bytes = 512 bytes per token
    llm = LLM(str(llama_dir), kv_cache_memory="64KiB", block_size=16)
    assert llm.engine.num_blocks == (64 << 10) // (512 * 16)


def test_a_budget_too_small_for_one_block_is_an_error(llama_dir):
    with pytest.raises(ValueError, match="holds no block of 16 tokens"):
        LLM(str(llama_dir), kv_cache_memory="1KiB")


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory, tiny_tokenizer):
    config = MistralConfig(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=1024, sliding_window=96, initializer_range=0.2,
                           eos_token_id=tiny_tokenizer.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(7)
    out = tmp_path_factory.mktemp("mistral") / "tiny-mistral"
    MistralForCausalLM(config).eval().save_pretrained(out)
    tiny_tokenizer.save_pretrained(out)
    return out


def test_mistral_runs_and_stays_inside_its_sliding_window(mistral_dir, tiny_tokenizer):
    llm = LLM(str(mistral_dir))
    assert llm.engine.spec.architecture == "MistralForCausalLM"
    assert llm.engine.max_model_len == 96  # windowed attention is not built yet: never exceed the window
    prompt = tiny_tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(mistral_dir, prompt, 30)
