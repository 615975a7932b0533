"""Native sliding-window attention (Mistral's `sliding_window`, Qwen2's upper layers): each query sees
exactly the last `window` keys, as HF masks them; when every layer slides, the blocks the window has
passed are freed, so a sequence of any length holds a bounded number of blocks."""

from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from llmaccel.llm import LLM
from llmaccel.model.spec import ModelSpec
from llmaccel.sampling_params import SamplingParams
from tests.tiny_models import hf_greedy

WINDOW = 40  # not a multiple of the block size: the mask, not the block table, decides what is seen


def _save(model_class, config, root, name: str, tokenizer):
    torch.manual_seed(7)
    out = root / name
    model_class(config).eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _common(tokenizer) -> dict:
    return dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2,
                eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory, tiny_tokenizer):
    config = MistralConfig(**_common(tiny_tokenizer), sliding_window=WINDOW)
    return _save(MistralForCausalLM, config, tmp_path_factory.mktemp("mistral"), "tiny-mistral", tiny_tokenizer)


@pytest.fixture(scope="module")
def qwen2_mixed_dir(tmp_path_factory, tiny_tokenizer):
    """Layer 0 attends fully, layer 1 within the window: the KV cache must keep every block."""
    config = Qwen2Config(**_common(tiny_tokenizer), use_sliding_window=True, sliding_window=WINDOW,
                         max_window_layers=1)
    assert config.layer_types == ["full_attention", "sliding_attention"]
    return _save(Qwen2ForCausalLM, config, tmp_path_factory.mktemp("qwen2"), "tiny-qwen2-swa", tiny_tokenizer)


def _prompt(n: int) -> list[int]:
    return [(i * 37) % 390 + 5 for i in range(n)]


def _greedy(llm: LLM, prompt: list[int], n: int) -> list[int]:
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return out[0].outputs[0].token_ids


def test_the_config_says_which_layers_slide():
    base = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 4, "num_attention_heads": 2, "sliding_window": 64}
    assert ModelSpec.from_hf_config(base).sliding_layers == ()  # Qwen2 slides only with use_sliding_window
    qwen = ModelSpec.from_hf_config({**base, "use_sliding_window": True, "max_window_layers": 3})
    assert (qwen.sliding_window, qwen.sliding_layers, qwen.kv_window) == (64, (3,), None)
    typed = ModelSpec.from_hf_config({**base, "use_sliding_window": True, "layer_types": ["sliding_attention",
                                      "full_attention", "sliding_attention", "full_attention"]})
    assert [typed.layer_window(i) for i in range(4)] == [64, None, 64, None]
    mistral = ModelSpec.from_hf_config({**base, "architectures": ["MistralForCausalLM"]})
    assert (mistral.sliding_layers, mistral.kv_window) == ((0, 1, 2, 3), 64)
    assert ModelSpec.from_hf_config({**base, "architectures": ["MistralForCausalLM"],
                                     "sliding_window": None}).sliding_window is None


def test_mistral_generates_far_past_its_window_token_identical_to_hf(mistral_dir):
    llm = LLM(str(mistral_dir), num_kv_blocks=16)
    assert llm.engine.max_model_len == 1024  # the window bounds the blocks, so only positions bound the length
    prompt = _prompt(12)
    assert _greedy(llm, prompt, 300) == hf_greedy(mistral_dir, prompt, 300)


def test_a_long_prompt_prefills_in_window_chunks_and_matches_hf(mistral_dir):
    prompt = _prompt(300)
    llm = LLM(str(mistral_dir))
    assert llm.engine.kv_cache.max_chunk == WINDOW
    assert _greedy(llm, prompt, 40) == hf_greedy(mistral_dir, prompt, 40)


def test_a_sequence_holds_at_most_the_blocks_its_window_reaches(mistral_dir):
    engine = LLM(str(mistral_dir), block_size=8).engine
    engine.add_request("long", _prompt(100), SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    most = 0
    while engine.has_unfinished_requests():
        engine.step(emit_unfinished=False)
        most = max(most, engine.num_blocks - engine.num_free_blocks)
    # a window-long chunk (40 tokens) on top of the 40-token window: ceil(80 / 8) + 1 blocks at most
    assert most <= 11
    assert engine.num_free_blocks == engine.num_blocks


def test_a_cached_prefix_is_taken_back_only_as_far_as_the_window_reaches(mistral_dir):
    llm = LLM(str(mistral_dir), block_size=8)
    shared = _prompt(200)
    first, second = shared + [11, 12, 13], shared + [21, 22, 23, 24, 25]
    assert _greedy(llm, first, 20) == hf_greedy(mistral_dir, first, 20)
    engine = llm.engine
    engine.add_request("second", second, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.step(emit_unfinished=False)
    request = engine.scheduler.running[0]
    assert request.num_cached_tokens == 200  # 25 blocks found cached ...
    # ... of which the window (40 tokens before position 200: blocks 20..24) is all it takes back
    assert request.num_skipped_blocks == 20
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step(emit_unfinished=False)
    assert outputs[0].outputs[0].token_ids == hf_greedy(mistral_dir, second, 20)
    assert engine.num_free_blocks == engine.num_blocks


def test_the_paged_kernel_and_the_torch_reference_agree_on_windowed_decoding(mistral_dir):
    prompt = _prompt(30)
    kernel, reference = LLM(str(mistral_dir)), LLM(str(mistral_dir), use_kernel=False)
    assert kernel.engine.runner.model.attention.uses_kernel
    assert _greedy(kernel, prompt, 150) == _greedy(reference, prompt, 150)


def test_a_model_mixing_full_and_windowed_layers_keeps_every_block_and_matches_hf(qwen2_mixed_dir):
    llm = LLM(str(qwen2_mixed_dir))
    assert llm.engine.kv_cache.window is None
    assert [layer.window for layer in llm.engine.runner.model.layers] == [None, WINDOW]
    prompt = _prompt(100)
    assert _greedy(llm, prompt, 100) == hf_greedy(qwen2_mixed_dir, prompt, 100)


def test_a_streaming_kv_window_on_a_sliding_window_model_is_refused(mistral_dir):
    with pytest.raises(ValueError, match="attends within its own sliding window of 40 tokens"):
        LLM(str(mistral_dir), kv_window=64)
