"""GGUF's tensor types as numbers: the block layouts of F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K.

`dequantize` turns a tensor's bytes into float32 with exactly the arithmetic of the `gguf` package's
`quants.dequantize` (float32 products in the same order: tests/test_gguf_quants.py holds them bit-equal), in
torch, so an embedding lookup dequantizes only the rows it reads. `quantize_k` writes the K-quant layouts
(round to nearest on a min/max grid, not llama.cpp's search: for tests and random-weight checkpoints; real
checkpoints come quantized by llama.cpp). Layouts (llama.cpp's ggml-common.h), a block of 32 or 256 weights:
- Q8_0 (34 B): d f16, 32 int8: w = d q.   Q4_0 (18 B): d, 16 bytes: w = d (q - 8).   Q4_1 (20 B): d, m: w = d q + m.
  (weight j < 16 in the low nibble of byte j, weight j + 16 in its high nibble)
- Q4_K (144 B / 256): d, dmin f16; 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32; 128 bytes of nibbles
  (sub-block 2c in the low nibbles of bytes 32c..32c+31, 2c + 1 in their high nibbles): w = d sc q - dmin m.
- Q5_K (176 B / 256): as Q4_K, with 32 bytes of fifth bits (sub-block j in bit j of byte l) before the nibbles.
- Q6_K (210 B / 256): 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per 16), d:
  w = d sc (q - 32).
"""

from __future__ import annotations

import numpy as np
import torch

# GGMLQuantizationType values (gguf.constants), named here so the hot paths need not import gguf
F32, F16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 8, 12, 13, 14, 30
# type -> (weights a block, bytes a block)
BLOCKS = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q8_0: (32, 34), Q4_0: (32, 18), Q4_1: (32, 20),
          Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
NAMES = {F32: "F32", F16: "F16", BF16: "BF16", Q8_0: "Q8_0", Q4_0: "Q4_0", Q4_1: "Q4_1", Q4_K: "Q4_K",
         Q5_K: "Q5_K", Q6_K: "Q6_K"}
DENSE = (F32, F16, BF16)


def row_bytes(tensor_type: int, row_length: int) -> int:
    block, nbytes = BLOCKS[tensor_type]
    return row_length // block * nbytes


def _half(raw: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte `at` of each block, as float32 [blocks, 1]."""
    return raw[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[blocks, c, 32] bytes -> [blocks, 2c, 32]: the low nibbles of each 32 bytes, then their high ones."""
    return torch.stack([qs & 0x0F, qs >> 4], dim=-2).flatten(-3, -2)


def k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> (scales, mins) [blocks, 8], each 6 bits."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mins


def q6_codes(raw: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks [n, 210] -> the 6-bit codes q (0..63) [n, 256]."""
    n = raw.shape[0]
    ql = raw[:, :128].reshape(n, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
    qh = raw[:, 128:192].reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    return ((ql & 0x0F).reshape(n, 256)) | ((qh & 0x03).reshape(n, 256) << 4)


def k_codes(raw: torch.Tensor, tensor_type: int) -> torch.Tensor:
    """Q4_K / Q5_K blocks [n, 144 or 176] -> codes q [n, 8, 32] (0..15 or 0..31)."""
    n = raw.shape[0]
    qs = raw[:, -128:].reshape(n, 4, 32)
    q = _nibbles(qs)
    if tensor_type == Q5_K:
        qh = raw[:, 16:48].reshape(n, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
        q = q | ((qh & 1) << 4)
    return q


def dequantize(raw: torch.Tensor, tensor_type: int, row_length: int) -> torch.Tensor:
    """uint8 rows [R, row_bytes] of a tensor of this type -> float32 [R, row_length], bit-equal to gguf's."""
    rows = raw.shape[0]
    if tensor_type == F32:
        return raw.contiguous().view(torch.float32).reshape(rows, row_length)
    if tensor_type == F16:
        return raw.contiguous().view(torch.float16).float().reshape(rows, row_length)
    if tensor_type == BF16:
        return (raw.contiguous().view(torch.int16).int() << 16).view(torch.float32).reshape(rows, row_length)
    if tensor_type not in BLOCKS:
        raise ValueError(f"GGML type {tensor_type} has no dequantizer here")
    block, nbytes = BLOCKS[tensor_type]
    blocks = raw.reshape(-1, nbytes)
    d = _half(blocks, 0)
    if tensor_type == Q8_0:
        out = blocks[:, 2:].contiguous().view(torch.int8).float() * d
    elif tensor_type == Q4_0:
        out = d * (_nibbles(blocks[:, 2:].reshape(-1, 1, 16)).reshape(-1, 32).to(torch.int8) - 8).float()
    elif tensor_type == Q4_1:
        out = d * _nibbles(blocks[:, 4:].reshape(-1, 1, 16)).reshape(-1, 32).float() + _half(blocks, 2)
    elif tensor_type in (Q4_K, Q5_K):
        sc, mins = k_scales(blocks[:, 4:16])
        scale = (d * sc.float()).unsqueeze(-1)
        offset = (_half(blocks, 2) * mins.float()).unsqueeze(-1)
        out = scale * k_codes(blocks, tensor_type).float() - offset
    else:  # Q6_K
        scale = (_half(blocks, 208) * blocks[:, 192:208].contiguous().view(torch.int8).float()).unsqueeze(-1)
        q = (q6_codes(blocks).to(torch.int8) - 32).float().view(-1, 16, 16)
        out = scale * q
    return out.reshape(rows, row_length)


# ---- writing K-quants (tests, random-weight checkpoints) ----------------------------------------------------

def _pack_k_scales(sc: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """(scales, mins) [n, 8] in 0..63 -> the 12 bytes k_scales reads."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (mins[:, :4] & 63) | ((mins[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mins[:, 4:] & 0x0F) << 4)
    return out


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(values.shape[0], 2)


def _quantize_k(blocks: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K/Q5_K arithmetic on [n, 256] float32: (d, dmin, scales, mins, codes [n, 8, 32])."""
    sub = blocks.reshape(-1, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0.0)  # mins are stored as -min >= 0
    scale = (sub.max(axis=-1) - low) / levels
    d = (scale.max(axis=-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (-low.min(axis=-1) / 63).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(0, 63).astype(np.uint8)
        mins = np.where(dmin[:, None] > 0, np.rint(-low / dmin[:, None]), 0).clip(0, 63).astype(np.uint8)
        step = d[:, None] * sc
        codes = np.where(step[..., None] > 0, np.rint((sub + (dmin[:, None] * mins)[..., None]) / step[..., None]), 0)
    return d, dmin, sc, mins, codes.clip(0, levels).astype(np.uint8)


def quantize_k(weights: np.ndarray, tensor_type: int) -> np.ndarray:
    """float32 [R, K] (K a multiple of 256) -> the bytes [R, K / 256 * block bytes] of a Q4_K, Q5_K or Q6_K tensor."""
    rows, k = weights.shape
    if k % 256:
        raise ValueError(f"K-quants need rows of a multiple of 256 weights, got {k}")
    blocks = np.ascontiguousarray(weights, dtype=np.float32).reshape(-1, 256)
    n = blocks.shape[0]
    if tensor_type in (Q4_K, Q5_K):
        d, dmin, sc, mins, codes = _quantize_k(blocks, 15 if tensor_type == Q4_K else 31)
        low = (codes & 0x0F).reshape(n, 4, 2, 32)
        qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
        parts = [_f16(d), _f16(dmin), _pack_k_scales(sc, mins)]
        if tensor_type == Q5_K:
            high = (codes >> 4) & 1  # [n, 8, 32]: bit j of byte l
            parts.append((high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1).astype(np.uint8))
        out = np.concatenate(parts + [qs], axis=1)
    elif tensor_type == Q6_K:
        sub = blocks.reshape(n, 16, 16)
        amax = np.abs(sub).max(axis=-1)
        d = (amax.max(axis=-1) / 31 / 127).astype(np.float16).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            sc = np.where(d[:, None] > 0, np.rint(amax / 31 / d[:, None]), 0).clip(-128, 127).astype(np.int8)
            step = (d[:, None] * sc)[..., None]
            q = np.where(step > 0, np.rint(sub / step), 0).clip(-32, 31).astype(np.int16) + 32
        q = q.reshape(n, 2, 128).astype(np.uint8)  # [block, half, e'], e' = 64 s + t for ql, 32 s2 + t2 for qh
        ql = (q & 0x0F).reshape(n, 2, 2, 64)
        qh = (q >> 4).reshape(n, 2, 4, 32)
        ql_bytes = (ql[:, :, 0] | (ql[:, :, 1] << 4)).reshape(n, 128)
        qh_bytes = (qh[:, :, 0] | (qh[:, :, 1] << 2) | (qh[:, :, 2] << 4) | (qh[:, :, 3] << 6)).reshape(n, 64)
        out = np.concatenate([ql_bytes, qh_bytes, sc.view(np.uint8), _f16(d)], axis=1)
    else:
        raise ValueError(f"quantize_k writes Q4_K, Q5_K and Q6_K, not GGML type {tensor_type}")
    return out.reshape(rows, -1)
