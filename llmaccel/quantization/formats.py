"""Weight-only quantization formats: INT8 per output channel (or per group) and INT4 group-wise.

INT8 (symmetric): w[n, k] ~= q[n, k] * scale[n], q in [-127, 127]. A grouped INT8 weight has a
scale per `group_size` inputs instead, scale[n, k // G]: GGUF's Q8_0 (32 weights share a float16 d).
INT4 (asymmetric, group G along the input dimension): w[n, k] ~= (q[n, k] - 8) * scale[n, g] + zero[n, g]
with g = k // G and q in [0, 15]. This is the convention of PyTorch's CPU int4 kernel, and GGUF's
Q4_1 (w = d * q + m over 32 weights) maps onto it exactly: scale = d, zero = m + 8 d.
Packed INT4 holds two weights per byte, the even column in the low nibble.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_GROUP_SIZES = (32, 64, 128)
METHODS = ("int8", "int4")


@dataclass
class Int8Weight:
    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N], or [N, K // group_size] when grouped
    group_size: int | None = None  # None: one scale per output channel

    def dequantize(self) -> torch.Tensor:
        if self.group_size is None:
            return self.q.float() * self.scale[:, None]
        n, k = self.q.shape
        return (self.q.float().view(n, k // self.group_size, self.group_size) * self.scale[..., None]).view(n, k)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()


@dataclass
class Int4Weight:
    packed: torch.Tensor  # uint8 [N, K // 2], two 4-bit values per byte
    scale: torch.Tensor  # float32 [N, K // G]
    zero: torch.Tensor  # float32 [N, K // G]
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        q = unpack_int4(self.packed).float().view(n, k // self.group_size, self.group_size)
        return ((q - 8) * self.scale[..., None] + self.zero[..., None]).view(n, k)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + (self.scale.numel() + self.zero.numel()) * self.scale.element_size()


KQUANT_LAYOUTS = {12: "q4_k", 13: "q5_k", 14: "q6_k"}  # GGML type -> the K-quant kernel's layout name


@dataclass
class PackedWeight:
    """A quantized weight already in one of llmaccel's CPU kernel layouts, repacked from a file's own blocks
    (a GGUF tensor) without expanding it: `layout` "int8" (ops/gemv.py's INT8 blocks with a float32 scale per
    32 inputs: GGUF Q8_0), "int4" (INT4 blocks with float16 scale and offset per 32: Q4_0, Q4_1) or "q4_k",
    "q5_k", "q6_k" (csrc/kquant.cpp's blocks for llama.cpp's K-quants)."""

    layout: str
    blocks: torch.Tensor  # uint8 [ceil(N / 16), K / 32 or K / 256, bytes a block]
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    @property
    def ggml_type(self) -> int | None:
        """The GGML type number of a K-quant layout, else None."""
        return next((t for t, name in KQUANT_LAYOUTS.items() if name == self.layout), None)


def concat_packed(weights: list[PackedWeight]) -> PackedWeight:
    """Same-layout packed weights stacked along the output dimension (every part but the last a whole number of
    16-row groups, as the kernels' blocks hold 16 rows)."""
    if any(w.out_features % 16 for w in weights[:-1]):
        raise ValueError("packed weights stack only at multiples of 16 rows")
    blocks = [w.blocks for w in weights]
    joined = _back_to_back(blocks)
    return PackedWeight(weights[0].layout, torch.cat(blocks) if joined is None else joined,
                        sum(w.out_features for w in weights), weights[0].in_features)


def _back_to_back(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The parts as one tensor without a copy, where they lie one after another in one storage (repacked in
    place at load: model/weight_arena.LoadArena), else None."""
    first, end = parts[0], parts[0].data_ptr()
    for part in parts:
        if (not part.is_contiguous() or part.data_ptr() != end or part.shape[1:] != first.shape[1:]
                or part.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return None
        end += part.nbytes
    return first.as_strided((sum(p.shape[0] for p in parts), *first.shape[1:]), first.stride())


def check_group_size(group_size: int, in_features: int, name: str = "a layer") -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"INT4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if in_features % group_size:
        raise ValueError(f"INT4 group size {group_size} does not divide the {in_features} input features of "
                         f"{name}; choose one of {[g for g in INT4_GROUP_SIZES if in_features % g == 0] or 'none'}")


# GGUF's Q4_0/Q4_1 grid. On the default model, groups of 64/128 cost +41.7% perplexity, groups of 32
# +0.05%, for 7 MiB more (docs/quantization.md).
DEFAULT_INT4_GROUP_SIZE = 32


def quantize(weight: torch.Tensor, method: str, group_size: int | None = None,
             name: str = "a layer") -> Int8Weight | Int4Weight:
    """Round-to-nearest quantization by method; an INT4 `group_size` of None means DEFAULT_INT4_GROUP_SIZE."""
    if method == "int8":
        return quantize_int8(weight)
    if method == "int4":
        return quantize_int4(weight, group_size or DEFAULT_INT4_GROUP_SIZE, name)
    raise ValueError(f"unknown quantization method {method!r}; choose one of {', '.join(METHODS)}")


def concat_weights(weights: list[Int8Weight] | list[Int4Weight] | list[PackedWeight]
                   ) -> Int8Weight | Int4Weight | PackedWeight:
    """Stack same-format weights along the output dimension (fused qkv / gate-up layers)."""
    if isinstance(weights[0], PackedWeight):
        return concat_packed(weights)
    if isinstance(weights[0], Int8Weight):
        return Int8Weight(torch.cat([w.q for w in weights]), torch.cat([w.scale for w in weights]),
                          weights[0].group_size)
    return Int4Weight(torch.cat([w.packed for w in weights]), torch.cat([w.scale for w in weights]),
                      torch.cat([w.zero for w in weights]), weights[0].group_size)


def same_format(weights: list[Int8Weight | Int4Weight | PackedWeight]) -> bool:
    """Whether these weights can be stacked into one fused layer (one format, one group size or layout, and
    packed parts that end on whole 16-row groups)."""
    if all(isinstance(w, PackedWeight) for w in weights):
        return len({w.layout for w in weights}) == 1 and all(w.out_features % 16 == 0 for w in weights[:-1])
    return len({(type(w), getattr(w, "group_size", None)) for w in weights}) == 1


# Rows quantized at once: each row's codes depend on that row alone, so slices give the whole matrix's bits while
# the float32 temporaries stay a few MB (whole, a 1B layer's fused gate-up made ~0.5 GB of them at load).
QUANTIZE_ROWS = 1024


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Round to nearest, one symmetric scale per output channel."""
    n = weight.shape[0]
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(n, dtype=torch.float32, device=weight.device)
    for start in range(0, n, QUANTIZE_ROWS):
        w = weight[start:start + QUANTIZE_ROWS].float()
        rows_scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
        q[start:start + QUANTIZE_ROWS] = torch.clamp(torch.round(w / rows_scale[:, None]), -127, 127)
        scale[start:start + QUANTIZE_ROWS] = rows_scale
    return Int8Weight(q, scale)


def quantize_int4(weight: torch.Tensor, group_size: int, name: str = "a layer") -> Int4Weight:
    """Round to nearest, an asymmetric (min/max) scale and zero per group of `group_size` inputs."""
    n, k = weight.shape
    check_group_size(group_size, k, name)
    packed = torch.empty(n, k // 2, dtype=torch.uint8, device=weight.device)
    scale = torch.empty(n, k // group_size, dtype=torch.float32, device=weight.device)
    zero = torch.empty_like(scale)
    for start in range(0, n, QUANTIZE_ROWS):
        w = weight[start:start + QUANTIZE_ROWS].float()
        w = w.view(w.shape[0], k // group_size, group_size)
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        rows_scale = ((high - low) / 15).clamp(min=1e-12)
        q = torch.clamp(torch.round((w - low[..., None]) / rows_scale[..., None]), 0, 15).to(torch.uint8)
        packed[start:start + QUANTIZE_ROWS] = pack_int4(q.view(w.shape[0], k))
        scale[start:start + QUANTIZE_ROWS] = rows_scale
        zero[start:start + QUANTIZE_ROWS] = low + 8 * rows_scale
    return Int4Weight(packed, scale, zero, group_size)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] with values 0..15 -> uint8 [N, K // 2] (even column in the low nibble)."""
    if q.shape[-1] % 2:
        raise ValueError("INT4 packing needs an even number of input features")
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)
