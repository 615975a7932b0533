"""Tiny random checkpoints of every family llmaccel runs (and a tiny byte-level BPE tokenizer) written to disk
with transformers' own save_pretrained, so llmaccel loads them exactly as it loads real ones."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    GPT2Config,
    LlamaConfig,
    LlamaForCausalLM,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values in blocks.",
    "Continuous batching packs every active request into each forward pass of the model.",
    "What is the capital of France? The capital of France is Paris. Tell me a story about a dragon.",
    "你好，世界！今天天气很好。我们一起去公园散步吧。人工智能正在改变世界。",
    "北京是中国的首都。请用中文回答这个问题。大语言模型的推理需要很多内存。",
    "def hello():\n    print('hello world')\n# numbers 0123456789 and symbols !@#$%^&*()",
] * 4


def build_tokenizer(vocab_size: int = 400) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _common(tokenizer: PreTrainedTokenizerFast) -> dict:
    return dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=0.2,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)


TINY_CONFIGS = {
    # grouped-query attention, untied LM head
    "llama-gqa": lambda t: LlamaConfig(**_common(t), num_attention_heads=4, num_key_value_heads=2,
                                       tie_word_embeddings=False, rope_theta=10000.0),
    # q/k/v bias (Qwen2)
    "qwen2-bias": lambda t: Qwen2Config(**_common(t), num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=False, rope_theta=100000.0),
    # tied embeddings, plain multi-head attention
    "llama-tied": lambda t: LlamaConfig(**_common(t), num_attention_heads=4, num_key_value_heads=4,
                                        tie_word_embeddings=True, rope_theta=100000.0),
    # the families beyond Llama (model/registry.py), each with the features that set it apart
    "qwen3": lambda t: Qwen3Config(**_common(t), num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   tie_word_embeddings=False, rope_theta=1000000.0),
    # fused qkv and gate_up; LongRoPE with an attention factor (4096 / 1024); every test stays within 1024
    "phi3": lambda t: Phi3Config(**{**_common(t), "max_position_embeddings": 4096}, num_attention_heads=4,
                                 num_key_value_heads=2, tie_word_embeddings=False, sliding_window=None,
                                 original_max_position_embeddings=1024,
                                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                  "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                                  "long_factor": [1.0 + 0.5 * i for i in range(8)],
                                                  "original_max_position_embeddings": 1024}),
    "gemma": lambda t: GemmaConfig(**_common(t), num_attention_heads=4, num_key_value_heads=1, head_dim=16),
    # one local layer (window 16) and one global; caps low enough to bite on a random model
    "gemma2": lambda t: Gemma2Config(**_common(t), num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     query_pre_attn_scalar=24, sliding_window=16, attn_logit_softcapping=2.0,
                                     final_logit_softcapping=3.0),
    # q/k norms; the local layer rotates by base 10^4, the global one by 10^6 with linear scaling
    "gemma3": lambda t: Gemma3TextConfig(**_common(t), num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         query_pre_attn_scalar=16, sliding_window=16,
                                         layer_types=["sliding_attention", "full_attention"],
                                         rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                                "rope_theta": 10000.0},
                                                          "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                             "rope_theta": 1000000.0}}),
    "gpt2": lambda t: GPT2Config(vocab_size=len(t), n_embd=64, n_layer=2, n_head=4, n_positions=1024,
                                 initializer_range=0.2, bos_token_id=t.bos_token_id, eos_token_id=t.eos_token_id,
                                 pad_token_id=t.pad_token_id),
}
LLAMA_FAMILY = ("llama-gqa", "qwen2-bias", "llama-tied")
FAMILIES = ("qwen3", "phi3", "gemma", "gemma2", "gemma3", "gpt2")


def make_tiny_model(name: str, root: Path, tokenizer: PreTrainedTokenizerFast) -> Path:
    config = TINY_CONFIGS[name](tokenizer)
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config).eval()
    if name.startswith("gemma"):
        # Gemma scales its embedding by sqrt(hidden): at the random init the token's own embedding then
        # dominates the residual stream and a tied head repeats the input token. Shrunk, the layers steer.
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(1 / config.hidden_size**0.5)
    out = root / name
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def make_long_llama(out: Path, tokenizer: PreTrainedTokenizerFast, num_layers: int, seed: int) -> Path:
    """A tiny llama whose positions reach past 3,000 tokens (4,096), for KV-window tests."""
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         rms_norm_eps=1e-5, initializer_range=0.2, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF transformers' own greedy generate, EOS ignored (the oracle)."""
    from transformers import GenerationConfig

    model = _hf_model(model_dir)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        mask = torch.ones(1, len(prompt_ids), dtype=torch.long)
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=mask, generation_config=config)
    return out[0, len(prompt_ids):].tolist()


_HF_CACHE: dict[str, object] = {}


def _hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    key = str(model_dir)
    if key not in _HF_CACHE:
        model = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # the oracle runs to max_new_tokens, as ignore_eos does
        _HF_CACHE[key] = model
    return _HF_CACHE[key]
