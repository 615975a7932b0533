"""Engine sizing: KV capacity, the context window it implies, and other architectures of the family."""

from __future__ import annotations

import logging

import pytest

from llmaccel.config import parse_memory_size
from llmaccel.errors import InvalidRequestError
from llmaccel.llm import LLM
from llmaccel.sampling_params import SamplingParams


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


