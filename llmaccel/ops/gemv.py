"""Weight-streaming linear kernels, from llmaccel's C++ CPU kernels (csrc/gemv.cpp, csrc/linear_f32.cpp).

With one to a few rows a linear layer is bound by reading its weights once. oneDNN's float32 path
reads them at ~11-14 GB/s at one row here and torch's INT8 weight-only kernel at ~7 GB/s; these
kernels read float32 at ~17-18 GB/s and INT8 at ~16 GB/s (2-core AMD EPYC, 17-23 GB/s measured read
bandwidth). INT8 and INT4 weights meet activations quantized to INT8 in blocks of 32 (llama.cpp's Q8
scheme), so the products are integer dot products; the INT8 kernel also beats torch's at 512 rows
(1.2x), so INT8 layers use it at every row count. Float32 weights live in panels of 16 output columns
(`to_panels`), which one kernel, `linear_f32`, reads at every row count (see ops/cpu_linear.py).

Each kernel is checked once against a float reference before anything uses it; where the C++ build
is missing, lacks AVX2, or fails the check, callers keep their other path.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch

from llmaccel.ops.cpu_kernels import checked_kernels, load_cpu_kernels

logger = logging.getLogger(__name__)
BLOCK = 32  # activation block and INT4 group width of the kernels
PANEL = 16  # output columns a panel of linear_f32's float32 layout


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> [ceil(N / 16), K, 16], N zero-padded: each panel is 16 rows of W, input-major."""
    n, k = weight.shape
    num_panels = -(-n // PANEL)
    padded = torch.nn.functional.pad(weight, (0, 0, 0, num_panels * PANEL - n))
    return padded.view(num_panels, PANEL, k).transpose(1, 2).contiguous()


GROUP_ROWS = 16  # weight rows a group of the INT8 and INT4 kernels' blocks


def pack_int8_blocks(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """INT8 weights w = q * scale (q int8 [N, K]; scale float [N] a row, or [N, K / 32]) -> the kernel's
    blocks, uint8 [ceil(N / 16), K / 32, 512 or 544] (csrc/gemv.cpp): per 16 rows and 32 inputs, 8 chunks
    of 64 bytes where byte 4 r + j of chunk t holds row r's input 4 t + j plus 128; then, for scales per
    32 inputs, the 16 rows' scales as float16 (GGUF Q8_0's own d: exact there; other scales are rounded).
    Row scales come back apart, float32 [16 ceil(N / 16)] (else None). Rows past N are zero weights with
    zero scales."""
    n, k = q.shape
    groups, nb = -(-n // GROUP_ROWS), k // BLOCK
    pad = groups * GROUP_ROWS - n
    shifted = (torch.nn.functional.pad(q.to(torch.int16), (0, 0, 0, pad)) + 128).to(torch.uint8)
    weights = shifted.view(groups, GROUP_ROWS, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(groups, nb, 512)
    scale = torch.nn.functional.pad(scale.float(), (0, 0, 0, pad) if scale.dim() == 2 else (0, pad))
    if scale.dim() == 1:
        return weights.contiguous(), scale.contiguous()
    per_block = scale.half().view(groups, GROUP_ROWS, nb).transpose(1, 2).contiguous().view(torch.uint8)
    return torch.cat([weights, per_block], dim=2).contiguous(), None


def pack_int4_blocks(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """INT4 weights w = q * scale + offset (q [N, K] in 0..15, scale and offset [N, K / 32]) -> the
    kernel's blocks, uint8 [ceil(N / 16), K / 32, 320] (csrc/gemv_int4.cpp): per 16 rows and 32 inputs,
    4 chunks of 64 bytes where byte 4 r + j of chunk t holds row r's input 8 t + j in its low nibble and
    8 t + 4 + j in its high nibble, then the 16 scales and the 16 offsets as float16. Rows past N are zero."""
    n, k = q.shape
    groups, nb = -(-n // GROUP_ROWS), k // BLOCK
    pad = groups * GROUP_ROWS - n
    q = torch.nn.functional.pad(q.to(torch.uint8), (0, 0, 0, pad)).view(groups, GROUP_ROWS, nb, 4, 2, 4)
    nibbles = (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)  # [G, nb, chunk, row, j]

    def halves(t: torch.Tensor) -> torch.Tensor:  # [N, nb] -> float16 bytes [G, nb, 32]
        t = torch.nn.functional.pad(t.half(), (0, 0, 0, pad)).view(groups, GROUP_ROWS, nb).transpose(1, 2)
        return t.contiguous().view(torch.uint8)

    return torch.cat([nibbles.reshape(groups, nb, 256), halves(scale), halves(offset)], dim=2).contiguous()


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _self_check(kernels: ModuleType) -> str | None:
    """None if every kernel matches its reference on random data, else what failed."""
    gen = torch.Generator().manual_seed(0)
    n, k = 40, 96
    for rows in (1, 3, 5, 7, 140):
        x = torch.randn(rows, k, generator=gen)
        w = torch.randn(n, k, generator=gen)
        if _relative_error(kernels.linear_f32(x, to_panels(w), n), x @ w.t()) > 1e-5:
            return "linear_f32"
        wb = w.bfloat16()
        if _relative_error(kernels.gemv_bf16(x, wb), x @ wb.float().t()) > 1e-5:
            return "gemv_bf16"
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        for scale in (torch.rand(n, generator=gen), torch.rand(n, k // BLOCK, generator=gen).half().float()):
            full = scale[:, None] if scale.dim() == 1 else scale.repeat_interleave(BLOCK, dim=1)
            blocks, row_scale = pack_int8_blocks(q, scale)
            if _relative_error(kernels.gemv_i8(x, blocks, row_scale, n), x @ (q.float() * full).t()) > 2e-2:
                return "gemv_i8"
            ids = torch.tensor([0, n - 1, 17])
            if not torch.equal(kernels.int8_rows(blocks, row_scale, ids), (q.float() * full)[ids]):
                return "int8_rows"
        q4 = torch.randint(0, 16, (n, k), generator=gen)
        s4 = torch.rand(n, k // BLOCK, generator=gen).half()
        o4 = torch.randn(n, k // BLOCK, generator=gen).half()
        deq = q4.float() * s4.float().repeat_interleave(BLOCK, 1) + o4.float().repeat_interleave(BLOCK, 1)
        if _relative_error(kernels.gemv_i4(x, pack_int4_blocks(q4, s4, o4), n), x @ deq.t()) > 2e-2:
            return "gemv_i4"
    return None


@functools.cache
def gemv_kernels() -> ModuleType | None:
    """The checked C++ kernels, or None where they cannot be used (the reason is logged once)."""
    kernels = load_cpu_kernels()
    if kernels is not None and hasattr(kernels, "gemv_vectorized") and not kernels.gemv_vectorized():
        logger.info("weight-streaming kernels built without AVX2; using oneDNN / torch's kernels")
        return None
    return checked_kernels("linear_f32", _self_check, "weight-streaming kernel")
