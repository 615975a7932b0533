"""The KV cache's element formats (`--kv-cache-dtype`), and INT8's in torch.

An INT8 pool row holds, for one token and KV head, head_dim int8 values and then their float16 scale
(head_dim + 2 bytes): x ~ q * scale with scale = max|x| / 127 rounded to float16. One scale per token and
head, as llama.cpp's q8_0 keeps one per 32 values, so rows are quantized once as they are written and
never again (a per-block scale would re-quantize a block as tokens arrive). The pool holds 1.94x the
tokens of bfloat16 at head_dim 64, 1.97x at 128. The C++ kernels (ops/csrc/kv_int8.cpp) write and read
the same bytes; the functions here are the path on other devices and the tests' reference.
"""

from __future__ import annotations

import torch

from llmaccel.config import kv_cache_dtype_name

SCALE_BYTES = 2
_INVERSE_127 = torch.tensor(1 / 127, dtype=torch.float32)


def kv_storage_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The pool's element dtype for a --kv-cache-dtype: auto is the model's dtype; float caches must be
    the model's dtype (the attention kernels read keys in the queries' dtype); fp8 (e4m3) only on a
    CUDA GPU that computes it. ValueError with the fix otherwise."""
    name = kv_cache_dtype_name(name)
    if name == "auto":
        return model_dtype
    if name == "int8":
        return torch.int8
    if name == "fp8":
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError(f"--kv-cache-dtype fp8 (e4m3) needs a CUDA GPU with fp8 (compute capability 8.9 or "
                             f"later); this is {device.type}: use --kv-cache-dtype int8 for a quantized KV cache")
        return torch.float8_e4m3fn
    dtype = torch.bfloat16 if name == "bfloat16" else torch.float32
    if dtype != model_dtype:
        raise ValueError(f"--kv-cache-dtype {name} differs from the model's dtype "
                         f"({str(model_dtype).removeprefix('torch.')}): a float KV cache is kept in the model's "
                         f"dtype; pass --dtype {name}, or --kv-cache-dtype auto or int8")
    return dtype


def row_width(head_dim: int, storage: torch.dtype) -> int:
    """Elements of one token's row of one KV head in the pool."""
    return head_dim + SCALE_BYTES if storage == torch.int8 else head_dim


def bytes_per_element_row(head_dim: int, storage: torch.dtype) -> int:
    """Bytes of one token's row of one KV head in the pool."""
    return row_width(head_dim, storage) * torch.empty((), dtype=storage).element_size()


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> [..., D + 2] int8 rows with their float16 scales (the bytes kv_int8.cpp writes)."""
    x = x.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) * _INVERSE_127.to(x.device)).half()
    wide = scale.float()
    inverse = torch.where(wide > 0, wide.reciprocal(), torch.zeros_like(wide))
    q = (x * inverse).round_().clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 2] int8 rows -> [..., D] in `dtype`."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float16).float()
    return (rows[..., :head_dim].float() * scale).to(dtype)


def stored(x: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """New keys or values [T, KVH, D] as the pool holds them."""
    if storage == torch.int8:
        return quantize_kv(x)
    if storage == torch.float8_e4m3fn:  # saturating, as vLLM's fp8 cache with a scale of 1 (e4m3fn has no inf)
        return x.clamp(-448.0, 448.0).to(storage)
    return x.to(storage)


def loaded(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Pool rows as the attention computes with them, in `dtype`."""
    if rows.dtype == torch.int8:
        return dequantize_kv(rows, dtype)
    return rows.to(dtype)
