"""Linear layers on llama.cpp's K-quants (Q4_K, Q5_K, Q6_K), computed on their own super-blocks.

A GGUF file's K-quant tensor is repacked once at load into csrc/kquant.cpp's blocks (16 rows side by side, the
6-bit scales kept as integers, d and dmin widened to float32: every weight exactly the file's) and multiplied
there at every row count, activations quantized to INT8 per 32 inputs as the INT4/INT8 kernels take them.
Measured on a 2-core AMD EPYC Zen 3 (AVX2) at [8192 x 2048]: one row streams Q4_K at ~37 GB/s, 64 rows run at
~250 GFLOP/s (float32 weights: ~150). On an AMX CPU a bfloat16 batch may instead take csrc/quant_amx.cpp's
kernel (each block of 32 columns dequantized to bfloat16 for AMX tiles), where `batch_choice` picks it, as INT8
and INT4 blocks do (ops/quant_linear.py). Without the CPU kernels (CUDA, no compiler) the loader dequantizes
K-quant tensors instead (model/gguf/weights.py).
"""

from __future__ import annotations

import torch
from torch import nn

from llmaccel.ops.block_kernels import BlockKernels
from llmaccel.ops.gemv import gemv_kernels
from llmaccel.quantization.formats import PackedWeight


class KQuantLinear(BlockKernels, nn.Module):
    """y = x W^T (+ b) for W in a K-quant layout ("q4_k", "q5_k", "q6_k"), in x's dtype (float32 sums)."""

    streams = True  # always in the kernels' blocks

    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        kernels = gemv_kernels()
        if kernels is None or not hasattr(kernels, "gemv_kq") or weight.ggml_type is None:
            raise ValueError(f"K-quant layers run on llmaccel's CPU kernels, which are not available here "
                             f"(or {weight.layout!r} is not a K-quant layout)")
        self._kernels = kernels
        self.layout, self.kind = weight.layout, weight.ggml_type
        self.blocks = weight.blocks
        self.out_features, self.in_features = weight.out_features, weight.in_features
        self.bias = bias

    @property
    def weight_bytes(self) -> int:
        return self.blocks.numel() + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def _stream(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernels.gemv_kq(x, self.blocks, self.kind, self.out_features)

    def _amx(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernels.kquant_linear_amx(x, self.blocks, self.kind, self.out_features)

    def float_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T (+ b) in float32, the kernel's sums as they come (for logits)."""
        out = self.block_product(x.reshape(-1, self.in_features)).float()
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block_product(x.reshape(-1, self.in_features)).to(x.dtype)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


class ConcatLinear(nn.Module):
    """One projection from parts in different formats, their outputs side by side (a GGUF file's q and k in
    Q4_K with its v in Q6_K, say): each part runs its own kernel; the bias is the whole projection's."""

    def __init__(self, parts: list[nn.Module], bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.bias = bias
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    @property
    def streams(self) -> bool:
        """Whether every part is in llmaccel's blocks (INT8, INT4, K-quants), so one batch choice serves all."""
        return all(getattr(p, "streams", False) for p in self.parts)

    @property
    def batch_choice(self):
        return self.parts[0].batch_choice if self.streams else None

    @batch_choice.setter
    def batch_choice(self, choice) -> None:
        for part in self.parts:
            part.batch_choice = choice

    def block_product(self, x: torch.Tensor, kernel: str | None = None) -> torch.Tensor:
        return torch.cat([p.block_product(x, kernel) for p in self.parts], dim=-1)

    def dequantized(self) -> torch.Tensor:
        return torch.cat([p.dequantized() for p in self.parts])

    @property
    def weight_bytes(self) -> int:
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return sum(p.weight_bytes for p in self.parts) + bias

    def float_forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([p.float_forward(x) if hasattr(p, "float_forward") else p(x).float() for p in self.parts],
                        dim=-1)
        return out if self.bias is None else out + self.bias.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([p(x) for p in self.parts], dim=-1)
        return out if self.bias is None else out + self.bias
