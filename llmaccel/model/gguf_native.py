"""GGUF's own quantized tensors as llmaccel INT4 / INT8 weights, with no dequantize/requantize round trip.

Q4_1 packs 32 weights as (d: f16, m: f16, 16 bytes): weight j is the low nibble of byte j and
weight j + 16 the high nibble, and w = d * q + m. That is INT4 group 32 with scale = d and
zero = m + 8 d in llmaccel's w = (q - 8) * scale + zero. Q4_0 (d, 16 bytes; w = d * (q - 8)) is
the same with zero = 0. Q8_0 (d: f16, 32 signed bytes; w = d * q) is grouped INT8 with group 32.
Other tensor types are left to the dense path.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from llmaccel.model.gguf_convert import hf_tensor_name, unpermute_rows
from llmaccel.model.gguf_tensors import read_tensors
from llmaccel.model.loader import resolve_model_path
from llmaccel.model.spec import ModelSpec
from llmaccel.quantization.formats import Int4Weight, Int8Weight, pack_int4

GROUP = 32
TABLES = ("model.embed_tokens.weight", "lm_head.weight")


def native_weights(model: str, spec: ModelSpec, include_embedding: bool = False) -> dict[str, Int4Weight | Int8Weight]:
    """The GGUF model's own quantized decoder tensors (for --quantization gguf), and with
    `include_embedding` its Q8_0 embedding / output tables; a clear error for other models."""
    path = resolve_model_path(model)
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"--quantization gguf needs a .gguf model, and {model!r} is not one; use int8 or int4")
    if spec.architecture != "LlamaForCausalLM":
        raise ValueError(f"--quantization gguf runs the quantized tensors of llama-architecture GGUF files; "
                         f"{path.name} is {spec.architecture}, whose tensors are dequantized on load: use int8 or int4")
    weights = gguf_quantized_weights(path, {"num_attention_heads": spec.num_heads,
                                            "num_key_value_heads": spec.num_kv_heads})
    if not any(name.startswith("model.layers.") for name in weights):
        raise ValueError(f"{path} has no Q4_0/Q4_1/Q8_0 tensors to use natively; use --quantization int8 or int4")
    if not include_embedding:
        weights = {name: w for name, w in weights.items() if name not in TABLES}
    return weights


def gguf_quantized_weights(path: Path, config: dict) -> dict[str, Int4Weight | Int8Weight]:
    """Every Q4_0 / Q4_1 / Q8_0 matrix of a llama GGUF file (decoder linears, embedding, output), by HF name."""
    import gguf

    types = gguf.GGMLQuantizationType
    block_bytes = {types.Q4_0: 18, types.Q4_1: 20, types.Q8_0: 34}
    out = {}
    for tensor in read_tensors(path):
        hf_name = hf_tensor_name(tensor.name)
        if tensor.tensor_type not in block_bytes or hf_name is None or len(tensor.shape) != 2:
            continue
        in_features = int(tensor.shape[0])  # GGUF lists dimensions innermost first
        raw = tensor.data
        blocks = raw.reshape(-1, in_features // GROUP, block_bytes[tensor.tensor_type])
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        if tensor.tensor_type == types.Q8_0:
            q = blocks[..., 2:].copy().view(np.int8).reshape(blocks.shape[0], in_features)
            q, d = (unpermute_rows(a, tensor.name, config) for a in (q, d))
            out[hf_name] = Int8Weight(_tensor(q), _tensor(d), GROUP)
            continue
        if tensor.tensor_type == types.Q4_1:
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            nibbles, zero = blocks[..., 4:], m + 8 * d
        else:
            nibbles, zero = blocks[..., 2:], np.zeros_like(d)
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(blocks.shape[0], in_features)
        q, d, zero = (unpermute_rows(a, tensor.name, config) for a in (q, d, zero))
        out[hf_name] = Int4Weight(pack_int4(_tensor(q)), _tensor(d), _tensor(zero), GROUP)
    return out


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array))
