"""Weight-only INT8 / INT4 linear layers.

INT8 with one scale per row and INT4 run llmaccel's own kernels on the CPU (ops/gemv.py: activations
quantized to INT8 in blocks of 32, integer dot products) at every row count: measured here they beat
torch's kernels from one row (INT8 2x, INT4 1.6-1.8x) to 512 (1.2-1.3x), and one kernel at every batch
size keeps a request's tokens independent of what it is batched with. Otherwise they call PyTorch's
own weight-only kernels, `torch._weight_int8pack_mm` and, for INT4, `torch._weight_int4pack_mm_for_cpu` on the CPU or
`torch._weight_int4pack_mm` (tinygemm) on CUDA.
In a bfloat16 model on an AMX CPU, llmaccel's blocks are also read by an AMX kernel at batches
(csrc/quant_amx.cpp: each block of 32 inputs of 16 columns dequantized to bf16 into an AMX tile):
`batch_choice` names the kernel per row count, timed at load (ops/kernel_choice.tune_quantized); None: the
streaming kernel always.
All of torch's want bfloat16 activations: the input is cast to bf16 around the call and the result back
(measured on this CPU: fast with bf16, ~20x slower with float32). Each kernel is checked once per
device type against a dequantized reference; where one is missing or fails, the fallback dequantizes
on the fly and multiplies in the activation dtype. Either way the weights stay packed in memory.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from llmaccel.ops.block_kernels import BlockKernels
from llmaccel.ops.gemv import BLOCK, gemv_kernels, pack_int4_blocks, pack_int8_blocks
from llmaccel.quantization.formats import Int4Weight, Int8Weight, PackedWeight, unpack_int4

logger = logging.getLogger(__name__)


@functools.cache
def int8_kernel_available(device_type: str = "cpu") -> bool:
    """Whether torch's weight-only INT8 kernel runs on this device type and gives the right numbers."""
    try:
        w = torch.randn(16, 64)
        q, s = torch.randint(-127, 128, (16, 64), dtype=torch.int8), w.abs().amax(1) / 127
        x = torch.randn(3, 64)
        got = torch._weight_int8pack_mm(*(t.to(device_type) for t in (x.bfloat16(), q, s.bfloat16()))).float().cpu()
        want = x.bfloat16().float() @ (q.float() * s.bfloat16().float()[:, None]).t()
        return bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item()))
    except Exception as exc:  # an older or differently built torch, or a GPU without the kernel
        logger.info("%s int8 weight-only kernel unavailable (%s); dequantizing on the fly", device_type, exc)
        return False


def int4_pack(q: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Unpacked INT4 values [N, K] (0..15) in the layout of this device's int4 kernel.

    CPU: `_convert_weight_to_int4pack_for_cpu` takes int32 [N, K]. CUDA (tinygemm, sm80+):
    `_convert_weight_to_int4pack` takes uint8 [N, K / 2] with the even column in the high nibble
    (the torchao/gpt-fast convention), tiled `inner_k_tiles` x 16 along K."""
    if device.type == "cpu":
        return torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
    k = q.shape[1]
    inner_k_tiles = next(t for t in (8, 4, 2) if k % (t * 16) == 0)
    q = q.to(torch.uint8)
    return torch._convert_weight_to_int4pack(((q[:, 0::2] << 4) | q[:, 1::2]).to(device), inner_k_tiles)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    kernel = torch._weight_int4pack_mm_for_cpu if x.device.type == "cpu" else torch._weight_int4pack_mm
    return kernel(x.to(torch.bfloat16), packed, group_size, scales_and_zeros)


@functools.cache
def int4_kernel_available(device_type: str = "cpu") -> bool:
    """Whether torch's weight-only INT4 kernel runs on this device type and gives the right numbers."""
    try:
        device = torch.device(device_type)
        q = torch.randint(0, 16, (16, 64), dtype=torch.int32)
        scale, zero = torch.rand(16, 2) + 0.5, torch.randn(16, 2)
        sz = torch.stack([scale.t(), zero.t()], dim=-1).bfloat16().contiguous()
        x = torch.randn(3, 64)
        got = int4_matmul(x.to(device), int4_pack(q, device), 32, sz.to(device)).float().cpu()
        deq = (q.float().view(16, 2, 32) - 8) * scale.bfloat16().float()[..., None] + zero.bfloat16().float()[..., None]
        want = x.bfloat16().float() @ deq.view(16, 64).t()
        return bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item()))
    except Exception as exc:
        logger.info("%s int4 weight-only kernel unavailable (%s); dequantizing on the fly", device_type, exc)
        return False


def _kernel_device(device: torch.device) -> bool:
    return device.type in ("cpu", "cuda")


class Int8Linear(BlockKernels, nn.Module):
    """INT8 weights, per output channel or grouped (GGUF Q8_0). The same matrix also serves as a
    quantized embedding table: `rows(ids)` dequantizes only the rows a lookup reads, so a tied
    embedding and LM head share one INT8 copy."""

    def __init__(self, weight: Int8Weight | PackedWeight, bias: torch.Tensor | None, device: torch.device,
                 use_kernel: bool | None = None) -> None:
        super().__init__()
        if isinstance(weight, PackedWeight):  # a file's Q8_0 blocks, repacked: the streaming kernel reads them
            self._packed(weight, bias)
            return
        self.out_features, self.in_features = weight.q.shape
        self.group_size = weight.group_size
        self.bias = bias
        if use_kernel is None:
            use_kernel = _kernel_device(device) and int8_kernel_available(device.type)
        self.use_kernel = use_kernel
        scale = weight.scale.to(device)
        streams = device.type == "cpu" and use_kernel is not False and self.in_features % BLOCK == 0
        self._gemv = gemv_kernels() if streams else None
        # llmaccel's kernel reads a scale per row or per 32 inputs as float16 (GGUF Q8_0's groups and d: the
        # tied table of a Q4_1 file is one); torch's takes one per row, so other groups, or group scales that
        # float16 would round, go a kernel call each
        grouped_ok = self.group_size is None or (self.group_size % BLOCK == 0
                                                 and torch.equal(scale.half().float(), scale.float()))
        self.streams = self._gemv is not None and grouped_ok
        if self.streams:  # llmaccel's blocks (ops/gemv.py), scales per row apart or per 32 inputs inside
            scale = scale.float()
            if self.group_size is not None:
                scale = scale.repeat_interleave(self.group_size // BLOCK, dim=1)
            self.blocks, self.row_scale = pack_int8_blocks(weight.q.to(device), scale)
        elif self.group_size is None:
            self.q = weight.q.to(device)
            self.scale_bf16 = scale.bfloat16()
            self.scale = scale.float().contiguous()
        else:  # [K / G, N, G]: each group's columns contiguous, one kernel call per group
            n, k, g = self.out_features, self.in_features, self.group_size
            self.q_groups = weight.q.to(device).view(n, k // g, g).permute(1, 0, 2).contiguous()
            self.scale = scale
            self.scale_groups = scale.t().bfloat16().contiguous()  # [K / G, N]

    def _packed(self, weight: PackedWeight, bias: torch.Tensor | None) -> None:
        if weight.layout != "int8" or gemv_kernels() is None:
            raise ValueError(f"Int8Linear takes packed INT8 blocks where the CPU kernels run, not {weight.layout!r}")
        self.out_features, self.in_features = weight.out_features, weight.in_features
        self.group_size, self.bias, self.use_kernel = BLOCK, bias, True
        self._gemv, self.streams = gemv_kernels(), True
        self.blocks, self.row_scale = weight.blocks, None

    @property
    def weight_bytes(self) -> int:
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        if self.streams:
            return self.blocks.numel() + (0 if self.row_scale is None else self.row_scale.numel() * 4) + bias
        return self.out_features * self.in_features + self.scale.numel() * self.scale.element_size() + bias

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized float32 rows `ids` of the weight: an embedding lookup."""
        if self.streams:
            return self._gemv.int8_rows(self.blocks, self.row_scale, ids)
        if self.group_size is None:
            return self.q[ids].float() * self.scale[ids, None]
        q = self.q_groups[:, ids].float() * self.scale[ids].t()[..., None]  # [K / G, T, G]
        return q.permute(1, 0, 2).reshape(len(ids), self.in_features)

    def _stream(self, x: torch.Tensor) -> torch.Tensor:
        return self._gemv.gemv_i8(x, self.blocks, self.row_scale, self.out_features)

    def _amx(self, x: torch.Tensor) -> torch.Tensor:
        return self._gemv.quant_linear_amx(x, self.blocks, self.row_scale, self.out_features, False)

    def float_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T (+ b) in float32: the streaming kernel's float32 sums as they come (for logits, where
        rounding them to bfloat16 first costs a pass over the vocabulary and only makes ties)."""
        if not self.streams:
            return self(x).float()
        out = self.block_product(x).float()
        return out if self.bias is None else out + self.bias.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.streams:
            out = self.block_product(x).to(x.dtype)
        elif self.group_size is not None:
            out = self._grouped(x)
        elif self.use_kernel:
            out = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.q, self.scale_bf16).to(x.dtype)
        else:  # x @ (q * s)^T == (x @ q^T) * s
            out = F.linear(x, self.q.to(x.dtype)) * self.scale.to(x.dtype)
        return out if self.bias is None else out + self.bias

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        """sum over groups g of (x_g @ q_g^T) * s_g; the kernel takes one scale per row, so one call per group."""
        num_groups = self.in_features // self.group_size
        if not self.use_kernel:
            weight = self.q_groups.to(x.dtype) * self.scale.t().to(x.dtype)[..., None]  # [K / G, N, G]
            return F.linear(x, weight.permute(1, 0, 2).reshape(self.out_features, self.in_features))
        x_groups = x.to(torch.bfloat16).view(-1, num_groups, self.group_size).transpose(0, 1).contiguous()
        out = torch.zeros(x.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        for g in range(num_groups):
            out += torch._weight_int8pack_mm(x_groups[g], self.q_groups[g], self.scale_groups[g])
        return out.to(x.dtype)


class Int4Linear(BlockKernels, nn.Module):
    def __init__(self, weight: Int4Weight | PackedWeight, bias: torch.Tensor | None, device: torch.device,
                 use_kernel: bool | None = None) -> None:
        super().__init__()
        self.bias = bias
        if isinstance(weight, PackedWeight):  # a file's Q4_0 / Q4_1 blocks, repacked
            if weight.layout != "int4" or gemv_kernels() is None:
                raise ValueError(f"Int4Linear takes packed INT4 blocks where the CPU kernels run, not "
                                 f"{weight.layout!r}")
            self.out_features, self.in_features, self.group_size = weight.out_features, weight.in_features, BLOCK
            self._gemv, self.blocks, self.use_kernel = gemv_kernels(), weight.blocks, True
            return
        self.out_features, self.in_features = weight.shape
        self.group_size = weight.group_size
        streams = device.type == "cpu" and use_kernel is not False
        self._gemv = gemv_kernels() if streams else None
        if self._gemv is not None:  # llmaccel's kernel at every row count: its own blocks, scales in float16
            repeats = self.group_size // BLOCK
            scale = weight.scale.repeat_interleave(repeats, dim=1)
            offset = (weight.zero - 8 * weight.scale).repeat_interleave(repeats, dim=1)
            self.blocks = pack_int4_blocks(unpack_int4(weight.packed), scale, offset)
            self.use_kernel = True
            return
        if use_kernel is None:
            use_kernel = _kernel_device(device) and int4_kernel_available(device.type)
        self.use_kernel = use_kernel
        if self.use_kernel:  # the kernel's own packed layout (also two weights per byte); drop ours
            self.packed = int4_pack(unpack_int4(weight.packed), device)
            scales_and_zeros = torch.stack([weight.scale.t(), weight.zero.t()], dim=-1)
            self.scales_and_zeros = scales_and_zeros.bfloat16().contiguous().to(device)
        else:
            self.weight = Int4Weight(weight.packed.to(device), weight.scale.to(device), weight.zero.to(device),
                                     weight.group_size)

    @property
    def weight_bytes(self) -> int:
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        if self._gemv is not None:
            return self.blocks.numel() + bias
        if self.use_kernel:
            return self.packed.numel() + self.scales_and_zeros.numel() * 2 + bias
        return self.weight.nbytes + bias

    @property
    def streams(self) -> bool:
        return self._gemv is not None

    def _stream(self, x: torch.Tensor) -> torch.Tensor:
        return self._gemv.gemv_i4(x, self.blocks, self.out_features)

    def _amx(self, x: torch.Tensor) -> torch.Tensor:
        return self._gemv.quant_linear_amx(x, self.blocks, None, self.out_features, True)

    def float_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T (+ b) in float32, as Int8Linear.float_forward."""
        if self._gemv is None:
            return self(x).float()
        out = self.block_product(x).float()
        return out if self.bias is None else out + self.bias.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._gemv is not None:
            out = self.block_product(x).to(x.dtype)
        elif self.use_kernel:
            out = int4_matmul(x, self.packed, self.group_size, self.scales_and_zeros).to(x.dtype)
        else:
            out = F.linear(x, self.weight.dequantize().to(x.dtype))
        return out if self.bias is None else out + self.bias


def quantized_linear(weight: Int8Weight | Int4Weight | PackedWeight, bias: torch.Tensor | None,
                     device: torch.device) -> nn.Module:
    """The layer that runs this quantized weight."""
    if isinstance(weight, PackedWeight) and weight.layout not in ("int8", "int4"):
        from llmaccel.ops.kquant_linear import KQuantLinear

        return KQuantLinear(weight, bias)
    if isinstance(weight, PackedWeight):
        return (Int8Linear if weight.layout == "int8" else Int4Linear)(weight, bias, device)
    layer = Int8Linear if isinstance(weight, Int8Weight) else Int4Linear
    return layer(weight, bias, device)
