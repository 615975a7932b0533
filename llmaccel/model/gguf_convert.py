"""GGUF -> an HF-format directory in the cache, keyed by the file's hash.

The llama architecture is converted here: tensors are dequantized with the `gguf` package (F32, F16,
BF16, Q8_0, Q4_0, Q4_1, ...), q/k rows are un-permuted back to HF's rotate-half layout (llama.cpp's
converter interleaves them). GPT-2 is read by transformers' own GGUF loader, which undoes llama.cpp's
changes (the transposed Conv1D projections), and written out. The tokenizer and chat template
are rebuilt from the GGUF metadata by transformers either way. Both llmaccel and the HF baseline then
load the same directory, so they see bit-identical weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from llmaccel.errors import CorruptCheckpointError, UnsupportedModelError

logger = logging.getLogger(__name__)

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# GGUF general.architecture -> the HF architecture its directory names (llama: converted here, the rest by
# transformers' GGUF loader)
# gguf files of the other families are not read yet: their GGUF metadata lacks fields (Qwen3's head_dim) that
# transformers' GGUF loader does not map, untested here; convert their HF checkpoints instead
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}
SUPPORTED_GGUF_ARCHITECTURES = tuple(GGUF_ARCHITECTURES)


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k permutation (interleaved rotary pairs -> rotate-half)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def gguf_to_hf_dir(path: Path, cache_root: Path) -> Path:
    """Convert once; later calls return the cached directory at once."""
    digest = file_digest(path)
    out = cache_root / "gguf" / f"{path.stem}-{digest[:16]}"
    if (out / "llmaccel-complete").exists():
        return out
    import gguf  # imported here: only GGUF users pay for it

    logger.warning("converting %s to an HF directory under %s (once per file)", path.name, out)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:
        raise CorruptCheckpointError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedModelError(f"{path}: GGUF architecture {arch!r} is not supported; "
                                    f"llmaccel reads {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    if arch == "llama":
        config = _config_from_metadata(reader, arch, path)
        state = _tensors(reader, config, path, gguf)
        config["tie_word_embeddings"] = "lm_head.weight" not in state
    else:
        del reader
        config, state = _read_with_transformers(path, GGUF_ARCHITECTURES[arch])

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        from safetensors.torch import save_file
        from transformers import AutoTokenizer

        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer.save_pretrained(str(tmp))
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}))
        (tmp / "llmaccel-complete").write_text(str(path) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _read_with_transformers(path: Path, architecture: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, float32 tensors by HF name) through transformers' GGUF loader (every tensor dequantized)."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except Exception as exc:
        raise CorruptCheckpointError(f"{path}: transformers cannot read this GGUF file "
                                     f"({type(exc).__name__}: {exc})") from exc
    config = model.config.to_dict()
    config["architectures"] = [architecture]
    state, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:  # the tied LM head: safetensors stores a tensor once
            continue
        seen.add(tensor.data_ptr())
        state[name] = tensor.detach().contiguous()
    if config.get("tie_word_embeddings", True):
        state.pop("lm_head.weight", None)
    return config, state


def _config_from_metadata(reader, arch: str, path: Path) -> dict:
    def need(key: str):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise CorruptCheckpointError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    num_heads = int(need("attention.head_count"))
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": int(need("embedding_length")),
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "vocab_size": int(_field(reader, f"{arch}.vocab_size", len(tokens))),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
        "hidden_act": "silu",
    }


def hf_tensor_name(gguf_name: str) -> str | None:
    """llama.cpp's tensor name -> HF transformers' (None for tensors llmaccel recomputes, e.g. rope_freqs)."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[parts[0]]}.{parts[1]}"
    return None


def unpermute_rows(values: np.ndarray, gguf_name: str, config: dict) -> np.ndarray:
    """Undo llama.cpp's q/k row interleaving on any per-row array (weights, scales, biases)."""
    parts = gguf_name.split(".")
    if parts[-2] == "attn_q":
        return _unpermute(values, config["num_attention_heads"])
    if parts[-2] == "attn_k":
        return _unpermute(values, config["num_key_value_heads"])
    return values


def _tensors(reader, config: dict, path: Path, gguf) -> dict[str, torch.Tensor]:
    state = {}
    for tensor in reader.tensors:
        name = tensor.name
        hf_name = hf_tensor_name(name)
        if hf_name is None:
            continue
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise UnsupportedModelError(f"{path}: tensor {name} has type {tensor.tensor_type.name}, "
                                        f"which the gguf package cannot dequantize") from exc
            values = np.asarray(values, dtype=np.float32).reshape([int(d) for d in reversed(tensor.shape)])
        except Exception as exc:
            raise CorruptCheckpointError(f"{path}: tensor {name} is unreadable, the file may be truncated "
                                         f"({type(exc).__name__}: {exc})") from exc
        values = unpermute_rows(values, name, config)
        state[hf_name] = torch.from_numpy(np.array(values, dtype=np.float32, order="C"))
    if "model.embed_tokens.weight" not in state:
        raise CorruptCheckpointError(f"{path}: GGUF has no token_embd.weight tensor")
    return state
