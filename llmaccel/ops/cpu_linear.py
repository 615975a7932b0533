"""Dense float32 linear layers on the CPU: llmaccel's panel kernel, or oneDNN with pre-packed weights.

Where the C++ kernels run (AVX2), a float32 weight is stored once in panels of 16 output columns
(`pack_panels`) and `linear_f32` (csrc/linear_f32.cpp) serves every row count from that one copy:
measured on a 2-core AMD EPYC (tools/linear_bench.py) 1.6-1.8x oneDNN's packed path at one row (it
reads the weights at the machine's bandwidth), on par at 64 rows, 0.85-0.9x at 256-1024 (prefill),
and its outputs do not depend on the batch. A tied LM head's table is the same copy: `panel_rows`
gathers embedding rows from it, so the model holds its largest matrix once.

Elsewhere (no AVX2 build), oneDNN with pre-packed weights: packing once at load time lets every
matmul skip oneDNN's per-call weight reorder: measured here 1.3-2x faster than `F.linear` at the
engine's shapes (the LM head at batch 64: 34 ms -> 17 ms). The op is PyTorch's own
(`torch.ops.mkldnn._linear_pointwise`, the one inductor uses on CPU); where it is missing or fails
its self-check, callers keep the plain weight and `F.linear`.

oneDNN builds (JIT-compiles) and caches a primitive per row count, ~600 KiB and ~1-2 ms each
(measured here), and a server sees every row count from 1 to --max-num-batched-tokens: left alone,
the caches grew a server by hundreds of MB under soak, and evicted primitives were rebuilt. So the
rows are padded up to eight buckets a doubling (`row_bucket`: at most 12.5% extra rows, none up to 16).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from llmaccel.ops.cpu_kernels import load_cpu_kernels
from llmaccel.ops.gemv import PANEL, gemv_kernels, to_panels
from llmaccel.ops.kernel_choice import DEFAULT_CHOICE, Bf16Choice, run_bf16

logger = logging.getLogger(__name__)
_BATCH_HINT = 64  # oneDNN tunes the packed layout for this many rows; any row count works


HALF_PANEL_DTYPES = (torch.bfloat16, torch.float16)


def pack_panels(weight: torch.Tensor, keep_half: bool = False) -> torch.Tensor | None:
    """W [N, K] -> [ceil(N / 16), K, 16] (N zero-padded), or None where the panel kernel does not apply. With
    `keep_half`, a bfloat16 or float16 weight keeps its dtype in the panels (the kernel widens each weight to
    float32 as it reads it: the sums are the float32 copy's from half the memory)."""
    allowed = (torch.float32, *HALF_PANEL_DTYPES) if keep_half else (torch.float32,)
    if weight.device.type != "cpu" or weight.dtype not in allowed or gemv_kernels() is None:
        return None
    return to_panels(weight.contiguous())


def panel_linear(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    out = gemv_kernels().linear_f32(x, panels, n)
    return out if bias is None else out + bias


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                choice: Bf16Choice = DEFAULT_CHOICE) -> torch.Tensor:
    """x @ weight.T (+ bias) for a bfloat16 CPU weight by the kernel `choice` names for x's rows
    (ops/kernel_choice.py). The bias is added after the product is rounded to x's dtype, as torch adds it."""
    kernel = choice.kernel(x.shape[0]) if x.dim() == 2 and x.dtype == torch.bfloat16 else "onednn"
    if kernel == "onednn":
        return F.linear(x, weight, bias)
    out = run_bf16(kernel, x, weight)
    return out if bias is None else out + bias


def layout_linear(x: torch.Tensor, weight: torch.Tensor, n: int, bias: torch.Tensor | None,
                  choice: Bf16Choice) -> torch.Tensor:
    """x @ W.T (+ bias) for a bf16 weight held in another layout than the plain one, packed for AMX
    (ops/csrc/linear_vnni.cpp) or compact (ops/csrc/bf16_compact.cpp), in x's dtype, by the kernel `choice`
    names for x's rows. Any leading dims; the rows run in bfloat16."""
    rows = x.reshape(-1, x.shape[-1])
    out = run_bf16(choice.kernel(rows.shape[0]), rows.to(torch.bfloat16), weight, n)
    out = out.to(x.dtype).reshape(*x.shape[:-1], n)
    return out if bias is None else out + bias


def compact_rows(compact: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a bf16 weight held in the compact layout: an embedding lookup."""
    return load_cpu_kernels().unpack_bf16_compact(compact, ids.cpu()).to(ids.device)


def vnni_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight [N, K] stored packed [N / 32, K / 2, 32, 2]: an embedding lookup."""
    return packed[ids // 32, :, ids % 32, :].reshape(*ids.shape, -1)


def panel_rows(panels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight [N, K] stored as panels: an embedding lookup in the tied table."""
    return panels[ids // PANEL, :, ids % PANEL]


@functools.cache
def packing_available() -> bool:
    try:
        weight = torch.randn(32, 16)
        x = torch.randn(3, 16)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_size=_BATCH_HINT)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(got, F.linear(x, weight), atol=1e-4))
    except Exception as exc:  # an older or differently built torch
        logger.info("oneDNN weight packing unavailable (%s); using F.linear", exc)
        return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN-packed copy of a float32 CPU weight [out, in], or None where packing does not apply."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not packing_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), batch_size=_BATCH_HINT)


def row_bucket(rows: int) -> int:
    """The row count oneDNN sees for `rows` rows: exact up to 16, then rounded up to a multiple of an
    eighth of the power of two below (18, 20, ..., 32, 36, ..., 64, 72, ...): eight buckets a doubling."""
    if rows <= 16:
        return rows
    step = (1 << (rows.bit_length() - 1)) // 8
    return -(-rows // step) * step


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] @ packed.T (+ bias), through one of a bounded set of oneDNN primitives."""
    rows = x.shape[0]
    padded = row_bucket(rows)
    if padded == rows:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    x = F.pad(x, (0, 0, 0, padded - rows))
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")[:rows]
