"""The two kernels of a weight held in llmaccel's blocks (INT8, INT4, K-quant records): the streaming one, whose
INT8 dot products are bound by the weight's read at a few rows, and the AMX one (csrc/quant_amx.cpp), which
dequantizes each block of 32 columns to bfloat16 for AMX tiles at batches. `batch_choice` (timed at load,
ops/kernel_choice.tune_quantized) names the kernel per row count.
"""

from __future__ import annotations

import torch

AMX_KERNEL = "dequant_amx"  # the name kernel_choice and the decode stack give csrc/quant_amx.cpp


class BlockKernels:
    """What Int8Linear, Int4Linear and KQuantLinear share where llmaccel's blocks hold the weight: the
    streaming kernel, the AMX kernel where `batch_choice` picks it, and the weight as float32 for checks."""

    batch_choice = None  # a kernel_choice.Bf16Choice over ("stream", AMX_KERNEL), or None: always streaming

    def _stream(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _amx(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def block_product(self, x: torch.Tensor, kernel: str | None = None) -> torch.Tensor:
        """x W^T without the bias: float32 sums by the streaming kernel, bfloat16 by the AMX one (used for
        2-D bfloat16 x where `kernel`, or else the batch choice for x's rows, names it)."""
        if kernel is None:
            choice = self.batch_choice
            kernel = choice.kernel(x.shape[0]) if choice is not None and x.dim() == 2 else "stream"
        if kernel == AMX_KERNEL and x.dim() == 2 and x.dtype == torch.bfloat16:
            return self._amx(x)
        return self._stream(x)

    def dequantized(self) -> torch.Tensor:
        """The weight [N, K] in float32, read through the streaming kernel (an identity's rows quantize
        exactly, so this is the weight the kernel multiplies)."""
        return self._stream(torch.eye(self.in_features)).t().contiguous()
