"""Write tiny GGUF files from tiny HF checkpoints, as llama.cpp's converter does: llama (q/k rows permuted
for interleaved RoPE) and gpt2; tensors in a chosen GGML type, tokenizer metadata."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's LlamaModel.permute."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _write_tokenizer(writer: gguf.GGUFWriter, tokenizer) -> None:
    import json

    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t for t, _ in vocab])
    special = set(tokenizer.all_special_ids)
    writer.add_token_types([3 if i in special else 1 for _, i in vocab])  # 3 = control, 1 = normal
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(tokenizer.chat_template)


K_QUANTS = (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K, gguf.GGMLQuantizationType.Q6_K)


def _add_tensor(writer: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> None:
    if data.ndim == 2 and qtype in K_QUANTS:  # the gguf package writes no K-quants; llmaccel's writer does
        from llmaccel.model.gguf.quants import quantize_k

        quantized = quantize_k(data, int(qtype))
        writer.add_tensor(name, quantized, raw_shape=quantized.shape, raw_dtype=qtype)
    elif data.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
        quantized = gguf.quants.quantize(data, qtype)
        writer.add_tensor(name, quantized, raw_shape=quantized.shape, raw_dtype=qtype)
    else:
        writer.add_tensor(name, data)


def _type_for(qtype: gguf.GGMLQuantizationType | dict, gguf_name: str) -> gguf.GGMLQuantizationType:
    if not isinstance(qtype, dict):
        return qtype
    return next((t for suffix, t in qtype.items() if suffix and gguf_name.endswith(suffix)), qtype[""])


def write_gpt2_gguf(model_dir: Path, out: Path, qtype: gguf.GGMLQuantizationType, config: dict, tokenizer) -> Path:
    """As llama.cpp's GPT2Model converter writes one: gguf's own tensor name map, the Conv1D projections
    transposed to [out, in], the attention mask buffers dropped, no output tensor (tied)."""
    weights = load_file(str(model_dir / "model.safetensors"))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT2, config["n_layer"])
    writer = gguf.GGUFWriter(str(out), "gpt2")
    writer.add_block_count(config["n_layer"])
    writer.add_context_length(config["n_positions"])
    writer.add_embedding_length(config["n_embd"])
    writer.add_feed_forward_length(4 * config["n_embd"])
    writer.add_head_count(config["n_head"])
    writer.add_layer_norm_eps(config["layer_norm_epsilon"])
    _write_tokenizer(writer, tokenizer)
    for name, tensor in weights.items():
        if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
            continue
        data = tensor.astype(np.float32)
        if name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            data = np.ascontiguousarray(data.T)
        _add_tensor(writer, names.get_name(name, try_suffixes=(".weight", ".bias")), data, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def write_gguf(model_dir: Path, out: Path, qtype: gguf.GGMLQuantizationType | dict, config: dict, tokenizer) -> Path:
    """`qtype`: one type for every matrix, or {gguf tensor name suffix (e.g. "attn_v.weight"): type} with "" as
    the default (a mixture, as llama.cpp's Q4_K_M)."""
    weights = load_file(str(model_dir / "model.safetensors"))
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    _write_tokenizer(writer, tokenizer)
    for name, tensor in weights.items():
        parts = name.split(".")
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            gguf_name = f"blk.{parts[2]}.{NAMES['.'.join(parts[3:-1])]}.{parts[-1]}"
        data = tensor.astype(np.float32)
        if gguf_name.endswith("attn_q.weight"):
            data = permute(data, config["num_attention_heads"])
        elif gguf_name.endswith("attn_k.weight"):
            data = permute(data, config["num_key_value_heads"])
        _add_tensor(writer, gguf_name, data, _type_for(qtype, gguf_name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def make_llama256(out: Path, tokenizer) -> Path:
    """A tiny Llama whose rows are whole K-quant super-blocks (hidden 256, intermediate 512; GQA, untied head),
    saved as an HF directory with the tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         rms_norm_eps=1e-5, initializer_range=0.05, tie_word_embeddings=False, rope_theta=10000.0,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(11)
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
