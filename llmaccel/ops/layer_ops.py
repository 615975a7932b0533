"""The small operations between a decoder layer's matmuls: RMSNorm (with the residual add folded in),
rotary embedding, SiLU-and-mul and GeLU-and-mul.

On the CPU each is one call into llmaccel's C++ kernels (csrc/layer_ops.cpp), float32 and bfloat16;
torch's own ops cost more in dispatch than in arithmetic at decode (one row of 576: F.rms_norm 37 us,
measured on a 2-core AMD EPYC). Elsewhere, and wherever the kernels are missing or fail their check
against the torch references below (HF transformers' Llama formulas), the references run.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F

from llmaccel.ops.cpu_kernels import checked_kernels


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # torch's fused kernel: the same formula
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_reference(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """qk [T, heads, D] rotated by the rows cos, sin [T, D] of its positions."""
    return qk * cos.unsqueeze(1) + rotate_half(qk) * sin.unsqueeze(1)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _self_check(kernels: ModuleType) -> str | None:
    """None if each kernel matches its reference on random rows (both dtypes), else which failed."""
    gen = torch.Generator().manual_seed(0)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x = torch.randn(5, 64, generator=gen).to(dtype)
        residual = torch.randn(5, 64, generator=gen).to(dtype)
        weight = torch.rand(64, generator=gen).to(dtype)
        if not torch.allclose(kernels.rms_norm(x, None, weight, 1e-5), rms_norm_reference(x, weight, 1e-5),
                              atol=tolerance, rtol=tolerance):
            return "rms_norm"
        summed = residual.clone()
        got = kernels.rms_norm(x, summed, weight, 1e-5)
        if not (torch.equal(summed, residual + x) and torch.allclose(
                got, rms_norm_reference(residual + x, weight, 1e-5), atol=tolerance, rtol=tolerance)):
            return "rms_norm with residual"
        angles = torch.rand(10, 8, generator=gen) * 6
        cos, sin = torch.cat((angles, angles), 1).cos().to(dtype), torch.cat((angles, angles), 1).sin().to(dtype)
        qkv = torch.randn(5, 4 * 16, generator=gen).to(dtype)
        positions = torch.tensor([0, 3, 9, 3, 1])
        want = rope_reference(qkv[:, :48].view(5, 3, 16), cos[positions], sin[positions])
        rotated = qkv.clone()
        kernels.rope_(rotated, 3, 16, positions, cos, sin)
        if not (torch.allclose(rotated[:, :48].view(5, 3, 16), want, atol=tolerance, rtol=tolerance)
                and torch.equal(rotated[:, 48:], qkv[:, 48:])):
            return "rope_"
        gate_up = torch.randn(5, 2 * 24, generator=gen).to(dtype)
        if not torch.allclose(kernels.silu_mul(gate_up), silu_mul_reference(gate_up), atol=tolerance,
                              rtol=tolerance):
            return "silu_mul"
        if not torch.allclose(kernels.gelu_tanh_mul(gate_up * 4), gelu_tanh_mul_reference(gate_up * 4),
                              atol=tolerance, rtol=tolerance):
            return "gelu_tanh_mul"
    return None


@functools.cache
def layer_kernels() -> ModuleType | None:
    """The checked C++ layer kernels, or None (the reason logged once)."""
    return checked_kernels("rms_norm", _self_check, "layer kernel")


def kernels_for(x: torch.Tensor) -> ModuleType | None:
    """The C++ kernels if they serve this tensor: rows [T, hidden] (each row contiguous) on the CPU in
    float32 or bfloat16."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2 or x.stride(1) != 1:
        return None
    return layer_kernels()


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    kernels = kernels_for(gate_up)
    if kernels is None or not gate_up.is_contiguous():
        return silu_mul_reference(gate_up)
    return kernels.silu_mul(gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU's gelu_tanh(gate) * up, by the C++ kernel the decode stack runs too (so the two agree to the bit)."""
    kernels = kernels_for(gate_up)
    if kernels is None or not gate_up.is_contiguous():
        return gelu_tanh_mul_reference(gate_up)
    return kernels.gelu_tanh_mul(gate_up)
