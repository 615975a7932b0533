"""Building blocks of the Llama family: RMSNorm, rotary embedding, fused linear layers.

Numerics follow HF transformers' Llama exactly (float32 normalisation, rotate-half RoPE), so
greedy outputs match it token for token.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from llmaccel.ops.cpu_linear import pack_weight, packed_linear
from llmaccel.ops.gemv import SMALL_ROWS, gemv_kernels
from llmaccel.ops.quant_linear import quantized_linear
from llmaccel.quantization.formats import quantize


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # torch's fused kernel: the same formula, bit-identical here
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(x.dtype)


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies of RoPE, with the 'linear' and 'llama3' scalings of HF transformers."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling {kind!r}; llmaccel supports default, linear and llama3")


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq = rope_inverse_frequencies(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor, qk: torch.Tensor) -> torch.Tensor:
        """qk: [T, H + KVH, D], queries and keys side by side so one pass rotates both; positions: [T]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return qk * cos + _rotate_half(qk) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Embedding(nn.Module):
    """A float embedding table. `rows(ids)` is the lookup, as on the INT8 table (ops/quant_linear.Int8Linear)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class Linear(nn.Module):
    """y = x W^T (+ b). On the CPU the weight is pre-packed for oneDNN (see ops/cpu_linear.py);
    the quantization issue swaps this module for packed-integer variants. `plain_is_shared`: the
    plain weight lives on anyway (a tied LM head's embedding table), so few-row products may stream
    it with the weight-streaming kernel (ops/gemv.py) at no memory cost."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, plain_is_shared: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed = pack_weight(weight)
        self.weight = None if self.packed is not None else weight  # keep one copy only
        self._gemv = gemv_kernels() if plain_is_shared and weight.dtype == torch.float32 and weight.is_cpu else None
        self._plain = weight if self._gemv is not None else None

    @property
    def weight_bytes(self) -> int:
        size = 4 if self.weight is None else self.weight.element_size()
        return self.out_features * self.in_features * size + (0 if self.bias is None else self.bias.numel() * size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._gemv is not None and x.shape[0] <= SMALL_ROWS and x.dtype == torch.float32:
            out = self._gemv.gemv_f32(x, self._plain)
            return out if self.bias is None else out + self.bias
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


def build_linear(weight: torch.Tensor, bias: torch.Tensor | None, quantization: str | None,
                 group_size: int | None, name: str) -> nn.Module:
    """A dense Linear, or a weight-only INT8 / INT4 one holding only the quantized weight (an INT4
    `group_size` of None takes the largest of 128, 64, 32 that divides this layer's inputs)."""
    if quantization is None:
        return Linear(weight, bias)
    return quantized_linear(quantize(weight, quantization, group_size, name), bias, weight.device)


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, gate_up: nn.Module, down: nn.Module) -> None:
        super().__init__()
        self.gate_up = gate_up
        self.down = down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def weight_bytes(model) -> int:
    """Bytes of every weight the model holds: linear layers report their own (packed or quantized)
    size, other parameters (embedding, norms) count as stored."""
    total = 0
    for module in model.modules():
        if hasattr(module, "weight_bytes"):
            total += module.weight_bytes
        else:
            total += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
    return total
