"""llama.cpp's names and layout for a llama-architecture GGUF file, against HF transformers': tensor names, the
config.json its metadata stands for, and the q/k row order llama.cpp's converter permutes (interleaved RoPE
pairs; HF's Llama rotates halves)."""

from __future__ import annotations

import numpy as np
import torch

from llmaccel.errors import CorruptCheckpointError
from llmaccel.model.gguf.reader import GGUFFile

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_HF_TO_GGUF = {**{v: k for k, v in _LAYER_TENSORS.items()}}


def hf_tensor_name(gguf_name: str) -> str | None:
    """llama.cpp's tensor name -> HF transformers' (None for tensors llmaccel recomputes, e.g. rope_freqs)."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[parts[0]]}.{parts[1]}"
    return None


def gguf_tensor_name(hf_name: str) -> str:
    """HF's name -> llama.cpp's (the inverse of hf_tensor_name)."""
    if hf_name.startswith("model.layers."):
        _, _, layer, rest = hf_name.split(".", 3)
        module, suffix = rest.rsplit(".", 1)
        return f"blk.{layer}.{_HF_TO_GGUF[module]}.{suffix}"
    module, suffix = hf_name.rsplit(".", 1)
    return f"{next(k for k, v in _GLOBAL_TENSORS.items() if v == module)}.{suffix}"


def unpermute_index(rows: int, num_heads: int) -> np.ndarray:
    """Row o of the HF-order matrix is row unpermute_index[o] of llama.cpp's (whose q/k rows interleave each
    head's rotary pairs)."""
    half = rows // num_heads // 2
    return np.arange(rows).reshape(num_heads, half, 2).swapaxes(1, 2).reshape(rows)


def permutation(gguf_name: str, rows: int, num_heads: int, num_kv_heads: int) -> np.ndarray | None:
    """What llama.cpp's converter does to a llama q/k tensor: its row r is HF's row permutation[r] (None for
    every other tensor)."""
    kind = gguf_name.split(".")[-2]
    if kind not in ("attn_q", "attn_k"):
        return None
    heads = num_heads if kind == "attn_q" else num_kv_heads
    return np.argsort(unpermute_index(rows, heads))


def row_order(gguf_name: str, rows: int, config: dict) -> np.ndarray | None:
    """The source row of each HF row for a llama file's q and k tensors (weights, biases), None for every other
    tensor (and for every tensor of a qwen2 file: its converter keeps HF's order)."""
    if config.get("model_type") != "llama":
        return None
    kind = gguf_name.split(".")[-2]
    if kind == "attn_q":
        return unpermute_index(rows, config["num_attention_heads"])
    if kind == "attn_k":
        return unpermute_index(rows, config["num_key_value_heads"])
    return None


def unpermute_rows(values: np.ndarray, gguf_name: str, config: dict) -> np.ndarray:
    """Undo llama.cpp's q/k row interleaving on any per-row array (weights, scales, biases)."""
    order = row_order(gguf_name, values.shape[0], config)
    return values if order is None else values[order]


FREQ_FACTORS_KEY = "llmaccel_rope_freq_factors"
ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}


def llama_config(metadata: GGUFFile) -> dict:
    """The config.json a llama- or qwen2-architecture GGUF file's metadata stands for."""
    arch, path = metadata.architecture, metadata.path
    if arch not in ARCHITECTURES:
        raise CorruptCheckpointError(f"{path}: GGUF architecture {arch!r} is not read in place "
                                     f"({', '.join(ARCHITECTURES)} are)")
    architecture, model_type = ARCHITECTURES[arch]

    def need(key: str):
        value = metadata.get(f"{arch}.{key}")
        if value is None:
            raise CorruptCheckpointError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    num_heads = int(need("attention.head_count"))
    vocab = metadata.get(f"{arch}.vocab_size") or metadata.array_length("tokenizer.ggml.tokens")
    if vocab is None:
        raise CorruptCheckpointError(f"{path}: GGUF metadata gives no vocabulary size ({arch}.vocab_size or the "
                                     "tokenizer's token list)")
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": int(need("embedding_length")),
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(metadata.get(f"{arch}.attention.head_count_kv") or num_heads),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(metadata.get(f"{arch}.context_length", 2048)),
        "vocab_size": int(vocab),
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
        "hidden_act": "silu",
    }
    head_dim = metadata.get(f"{arch}.attention.key_length")
    if head_dim is not None and int(head_dim) != config["hidden_size"] // num_heads:
        config["head_dim"] = int(head_dim)
    freqs = metadata.tensors.get("rope_freqs.weight")
    if freqs is not None:  # Llama 3's scaling as llama.cpp's converter stores it: per-frequency divisors
        from llmaccel.model.gguf.quants import dequantize

        factors = dequantize(torch.from_numpy(freqs.data).view(1, -1), freqs.tensor_type, int(freqs.shape[0]))
        config[FREQ_FACTORS_KEY] = [float(f) for f in factors[0]]  # (a key transformers leaves alone)
    kind, factor = metadata.get(f"{arch}.rope.scaling.type"), metadata.get(f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor:
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    return config
