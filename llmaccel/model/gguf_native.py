"""GGUF's own 4-bit tensors as llmaccel INT4 weights, with no dequantize/requantize round trip.

Q4_1 packs 32 weights as (d: f16, m: f16, 16 bytes): weight j is the low nibble of byte j and
weight j + 16 the high nibble, and w = d * q + m. That is INT4 group 32 with scale = d and
zero = m + 8 d in llmaccel's w = (q - 8) * scale + zero. Q4_0 (d, 16 bytes; w = d * (q - 8)) is
the same with zero = 0. Other tensor types (Q8_0's per-32-weight scales do not fit INT8's per-channel
scale) are left to the dense path.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from llmaccel.model.gguf_convert import hf_tensor_name, unpermute_rows
from llmaccel.model.loader import resolve_model_path
from llmaccel.model.spec import ModelSpec
from llmaccel.quantization.formats import Int4Weight, pack_int4

GROUP = 32


def native_int4_weights(model: str, spec: ModelSpec) -> dict[str, Int4Weight]:
    """The GGUF model's own 4-bit tensors (for --quantization gguf); a clear error for other models."""
    path = resolve_model_path(model)
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"--quantization gguf needs a .gguf model, and {model!r} is not one; use int8 or int4")
    weights = gguf_int4_weights(path, {"num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads})
    if not weights:
        raise ValueError(f"{path} has no Q4_0/Q4_1 tensors to use natively; use --quantization int8 or int4")
    return weights


def gguf_int4_weights(path: Path, config: dict) -> dict[str, Int4Weight]:
    """Every Q4_0 / Q4_1 linear weight of a llama GGUF file, by HF tensor name."""
    import gguf

    kinds = {gguf.GGMLQuantizationType.Q4_0: 18, gguf.GGMLQuantizationType.Q4_1: 20}  # bytes per block
    out = {}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        hf_name = hf_tensor_name(tensor.name)
        if tensor.tensor_type not in kinds or hf_name is None or not hf_name.startswith("model.layers."):
            continue
        in_features = int(tensor.shape[0])  # GGUF lists dimensions innermost first
        blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(-1, in_features // GROUP, kinds[tensor.tensor_type])
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        if tensor.tensor_type == gguf.GGMLQuantizationType.Q4_1:
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            nibbles, zero = blocks[..., 4:], m + 8 * d
        else:
            nibbles, zero = blocks[..., 2:], np.zeros_like(d)
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(blocks.shape[0], in_features)
        q, d, zero = (unpermute_rows(a, tensor.name, config) for a in (q, d, zero))
        out[hf_name] = Int4Weight(pack_int4(torch.from_numpy(np.ascontiguousarray(q))),
                                  torch.from_numpy(np.ascontiguousarray(d)),
                                  torch.from_numpy(np.ascontiguousarray(zero)), GROUP)
    return out
