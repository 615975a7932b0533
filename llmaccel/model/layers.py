"""Building blocks of the Llama family: RMSNorm, rotary embedding, fused linear layers.

Numerics follow HF transformers' Llama exactly (float32 normalisation, rotate-half RoPE), so
greedy outputs match it token for token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmaccel.model.rope import rope_tables
from llmaccel.model.weight_arena import LoadArena
from llmaccel.ops.cpu_linear import (
    bf16_linear,
    compact_rows,
    layout_linear,
    pack_panels,
    pack_weight,
    packed_linear,
    panel_linear,
    panel_rows,
    vnni_rows,
)
from llmaccel.ops.kernel_choice import DEFAULT_CHOICE, Bf16Choice, layout_weight
from llmaccel.ops.layer_ops import gelu_tanh_mul, kernels_for, rms_norm_reference, rope_reference, silu_mul
from llmaccel.ops.quant_linear import quantized_linear
from llmaccel.quantization.formats import quantize


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = kernels_for(x)
        if kernels is None:
            return rms_norm_reference(x, self.weight, self.eps)
        return kernels.rms_norm(x, None, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the residual stream's add folded into the norm. The
        residual tensor is updated in place where the kernels run: it must be the caller's own."""
        kernels = kernels_for(x)
        if kernels is None or not residual.is_contiguous():
            residual = residual + x
            return rms_norm_reference(residual, self.weight, self.eps), residual
        return kernels.rms_norm(x, residual, self.weight, self.eps), residual


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 dtype: torch.dtype, max_position_embeddings: int | None = None) -> None:
        super().__init__()
        cos, sin = rope_tables(head_dim, max_positions, theta, scaling, max_position_embeddings)
        self.register_buffer("cos", cos.to(dtype), persistent=False)
        self.register_buffer("sin", sin.to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor, qk: torch.Tensor) -> torch.Tensor:
        """qk: [T, H + KVH, D], queries and keys side by side so one pass rotates both; positions: [T]."""
        return rope_reference(qk, self.cos[positions], self.sin[positions])

    def rotate(self, positions: torch.Tensor, qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
               head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [T, H, D], k [T, KVH, D]) rotated, from the fused projection qkv [T, (H + 2 KVH) D]; in
        place (q and k are views of qkv) where the kernels run."""
        tokens, q_size = qkv.shape[0], num_heads * head_dim
        kernels = kernels_for(qkv)
        if kernels is not None and self.cos.dtype == qkv.dtype:
            kernels.rope_(qkv, num_heads + num_kv_heads, head_dim, positions, self.cos, self.sin)
            qk = qkv[:, : q_size + num_kv_heads * head_dim].view(tokens, -1, head_dim)
        else:
            qk = self(positions, qkv[:, : q_size + num_kv_heads * head_dim].view(tokens, -1, head_dim))
        q, k = qk.split([num_heads, num_kv_heads], dim=1)
        return q, k


class Embedding(nn.Module):
    """A float embedding table. `rows(ids)` is the lookup, as on the INT8 table (ops/quant_linear.Int8Linear)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class Linear(nn.Module):
    """y = x W^T (+ b), holding one copy of the weight. Float32 on the CPU: llmaccel's panel layout
    and kernel at every row count, or (no AVX2 build) oneDNN's pre-packed layout (ops/cpu_linear.py);
    otherwise the plain weight and F.linear (bfloat16 on the CPU: the kernel its `bf16_choice` names for
    the rows, in that choice's layout: plain, packed for AMX in `vnni`, or 12 bits a weight in `compact`
    once `set_bf16_choice` asks for it). The quantization issue swaps this module for packed-integer
    variants. `rows(ids)` looks rows up (a tied embedding table) where the layout allows."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, keep_half: bool = False) -> None:
        """`keep_half`: a bfloat16 / float16 weight in a float32 model stays in its dtype, in half-precision
        panels that the float32 kernel widens as it reads (a bf16 or f16 checkpoint on a CPU without bf16
        arithmetic: the same sums from half the memory); elsewhere it is cast as the model's dtype asks."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.panels = pack_panels(weight, keep_half)
        if keep_half and self.panels is None:
            weight = weight.float()
        elif keep_half and self.panels.dtype != torch.float32 and bias is not None:
            self.bias = bias.float()
        self.packed = pack_weight(weight) if self.panels is None else None
        self.weight = weight if self.panels is None and self.packed is None else None
        self.vnni: torch.Tensor | None = None  # a bf16 weight packed for AMX, in place of `weight`
        self.compact: torch.Tensor | None = None  # a bf16 weight in 12 bits a weight, in place of `weight`
        self.bf16_choice = DEFAULT_CHOICE  # which kernel at which rows, for a bf16 CPU weight (tuned at load)

    @property
    def is_bf16(self) -> bool:
        """Whether this is a bf16 CPU weight, which runs the kernels `bf16_choice` names."""
        if self.vnni is not None or self.compact is not None:
            return True
        return self.weight is not None and self.weight.dtype == torch.bfloat16 and self.weight.device.type == "cpu"

    def set_bf16_choice(self, choice: Bf16Choice, arena: LoadArena | None = None) -> None:
        """Run `choice`'s kernels from now on, the weight moved into its layout (one copy either way: a plain
        weight read in place at load hands its pages back, model/weight_arena.LoadArena.give_back). `arena`:
        where a weight moved to the compact layout is written (and then streamed from), else memory of its own."""
        held = "vnni" if self.vnni is not None else "compact" if self.compact is not None else "plain"
        if choice.layout != held and held != "plain":
            raise ValueError(f"a bf16 weight in the {held} layout cannot move to the {choice.layout} one")
        if choice.layout in ("vnni", "compact") and held == "plain":
            into = arena.rest() if arena is not None and choice.layout == "compact" else None
            moved, old = layout_weight(self.weight, choice.layout, into), self.weight
            if into is not None:
                arena.claim(moved)
            self.weight = None
            if choice.layout == "vnni":
                self.vnni = moved
            else:
                self.compact = moved
            LoadArena.give_back(old)
        self.bf16_choice = choice

    @property
    def weight_bytes(self) -> int:
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        if self.panels is not None:  # float32 (or half precision), rows padded to a whole panel
            return self.panels.numel() * self.panels.element_size() + bias
        if self.packed is not None:  # an opaque oneDNN tensor of float32
            return self.out_features * self.in_features * 4 + bias
        if self.vnni is not None:  # bf16, columns padded to a whole block of 32
            return self.vnni.numel() * 2 + bias
        if self.compact is not None:
            return self.compact.numel() + bias
        return self.weight.numel() * self.weight.element_size() + bias

    @property
    def has_rows(self) -> bool:
        return self.packed is None

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            return panel_rows(self.panels, ids)
        if self.vnni is not None:
            return vnni_rows(self.vnni, ids)
        if self.compact is not None:
            return compact_rows(self.compact, ids)
        if self.weight is None:
            raise ValueError("a oneDNN-packed weight cannot be read by rows")
        return F.embedding(ids, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            return panel_linear(x, self.panels, self.out_features, self.bias).to(x.dtype)
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        if self.vnni is not None:
            return layout_linear(x, self.vnni, self.out_features, self.bias, self.bf16_choice)
        if self.compact is not None:
            return layout_linear(x, self.compact, self.out_features, self.bias, self.bf16_choice)
        if self.weight.dtype == torch.bfloat16 and self.weight.device.type == "cpu":
            return bf16_linear(x, self.weight, self.bias, self.bf16_choice)
        return F.linear(x, self.weight, self.bias)


def build_linear(weight: torch.Tensor, bias: torch.Tensor | None, quantization: str | None,
                 group_size: int | None, name: str) -> nn.Module:
    """A dense Linear, or a weight-only INT8 / INT4 one holding only the quantized weight (an INT4
    `group_size` of None takes the largest of 128, 64, 32 that divides this layer's inputs)."""
    if quantization is None:
        return Linear(weight, bias)
    return quantized_linear(quantize(weight, quantization, group_size, name), bias, weight.device)


class GatedMLP(nn.Module):
    """SwiGLU, down(silu(gate(x)) * up(x)), or with `activation` gelu_tanh GeGLU (Gemma); gate and up fused
    into one matmul."""

    def __init__(self, gate_up: nn.Module, down: nn.Module, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"unsupported MLP activation {activation!r}; llmaccel runs silu and gelu_tanh")
        self.gate_up = gate_up
        self.down = down
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "silu":
            return self.down(silu_mul(self.gate_up(x)))
        return self.down(gelu_tanh_mul(self.gate_up(x)))


def weight_bytes(model) -> int:
    """Bytes of every weight the model holds: linear layers report their own (packed or quantized)
    size, taking in their parts (ops/kquant_linear.ConcatLinear), other parameters (embedding, norms) count
    as stored."""
    if hasattr(model, "weight_bytes"):
        return model.weight_bytes
    own = sum(p.numel() * p.element_size() for p in model.parameters(recurse=False))
    return own + sum(weight_bytes(child) for child in model.children())
