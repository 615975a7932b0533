"""Many LoRA adapters in one batch: each projection's adapters stacked, the step's rows grouped by adapter.

As S-LoRA / Punica batch them (SGMV: segmented gather matrix-vector): every loaded adapter owns a share of
`parts x max_rank` rows in the projection's stacked A (`[max_loras x share, in]`) and B^T (`[max_loras x share,
out]`, the scaling folded in; block-diagonal where q, k and v, or gate and up, are fused). For a step whose rows
carry adapters, the rows are gathered into one segment per adapter slot lo..hi-1 (padded to the longest), and

    shrink = bmm(x[segments], A[lo:hi]^T)    every segment against its own adapter's A, in one call
    y[rows] += bmm(shrink, B^T[lo:hi])       and its B, added to the base projection's output

so requests for different adapters (and the base model) share the step's base matmul and two batched small
ones, instead of a pass per adapter, and a row pays for its own adapter's rank only (measured against masking
every row over all adapters' columns: 0.80x against 0.77x the base at the 1B shape, docs/benchmarks.md). A step
with no adapter rows runs the base projection alone (bit-identical to a model served without LoRA); a row
without an adapter is its base row. On the CPU the same sums are one call of the kernels (csrc/lora.cpp), which
also skips the zeros of a fused projection's block-diagonal B^T: the torch ops cost ~300 us of dispatch a
projection.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from llmaccel.lora.adapter import PARTS, LoRAPiece
from llmaccel.model.layers import weight_bytes
from llmaccel.ops.gemv import gemv_kernels


class LoRABatch:
    """The adapter segments of the current forward pass (set by the runner before each pass)."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.active = False  # whether a row of the pass has an adapter
        self.slots = None  # each row's slot, int64 (the CPU kernel's input)
        self._segments: Segments | None = None  # the torch path's, made at its first use in a pass

    def set_rows(self, slots: list[int]) -> None:
        """`slots`: each row's adapter slot, -1 for the base model."""
        self.active = any(s >= 0 for s in slots)
        self._segments = None
        if self.active:
            self.slots = torch.tensor(slots, dtype=torch.long)

    def segments(self) -> Segments:
        """The rows of each slot lo..hi-1 side by side, padded with row 0 (their results are dropped): built
        once a pass, and only where the torch ops add the deltas (the CPU kernel reads `slots`)."""
        if self._segments is None:
            slots = self.slots.tolist()
            used = {s for s in slots if s >= 0}
            lo, hi = min(used), max(used) + 1
            members = [[i for i, s in enumerate(slots) if s == slot] for slot in range(lo, hi)]
            width = max(len(m) for m in members)
            self._segments = Segments(
                lo, hi, torch.tensor([m + [0] * (width - len(m)) for m in members], device=self.device),
                torch.tensor([j * width + i for j, m in enumerate(members) for i in range(len(m))], device=self.device),
                torch.tensor([i for m in members for i in m], device=self.device))
        return self._segments


class Segments(NamedTuple):
    lo: int  # the slots of the pass's adapters lie in lo..hi-1
    hi: int
    gather: torch.Tensor  # [hi - lo, width]: each slot's rows, padded
    kept: torch.Tensor  # the real rows' places in the flattened segments
    targets: torch.Tensor  # and the rows they are


class LoRALinear(nn.Module):
    """A projection (dense, INT8, INT4 or a GGUF format: any module) plus the LoRA deltas of the loaded adapters."""

    def __init__(self, base: nn.Module, batch: LoRABatch, module: str, max_loras: int, max_rank: int,
                 in_features: int, out_features: int) -> None:
        super().__init__()
        self.base, self.batch = base, batch
        self.max_rank = max_rank
        self.share = PARTS[module] * max_rank
        cols = max_loras * self.share
        self.register_buffer("a", torch.zeros(cols, in_features, device=batch.device, dtype=batch.dtype),
                             persistent=False)
        self.register_buffer("b_t", torch.zeros(cols, out_features, device=batch.device, dtype=batch.dtype),
                             persistent=False)
        # the columns each part's rows of B^T touch (q, k, v or gate, up where fused), set as adapters load
        self.part_columns = torch.tensor([[0, out_features]] * PARTS[module], dtype=torch.long)
        kernels = gemv_kernels() if batch.device.type == "cpu" else None
        self._kernels = kernels if kernels is not None and hasattr(kernels, "lora_add_") else None

    @property
    def weight_bytes(self) -> int:
        return weight_bytes(self.base) + (self.a.numel() + self.b_t.numel()) * self.a.element_size()

    def load(self, slot: int, piece: LoRAPiece) -> None:
        rank, rows = piece.a.shape[0], piece.b.shape[0]
        first = slot * self.share + piece.part * self.max_rank
        self.a[first:first + rank] = piece.a.to(self.a.device)
        self.b_t[first:first + rank, piece.row_start:piece.row_start + rows] = piece.b.t().to(self.a.device)
        self.part_columns[piece.part] = torch.tensor([piece.row_start, piece.row_start + rows])

    def clear(self, slot: int) -> None:
        self.a[slot * self.share:(slot + 1) * self.share] = 0
        self.b_t[slot * self.share:(slot + 1) * self.share] = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.batch
        if not batch.active:
            return y
        if self._kernels is not None and x.dim() == 2 and x.dtype == y.dtype == self.a.dtype and y.is_contiguous():
            self._kernels.lora_add_(y, x.contiguous(), self.a, self.b_t, batch.slots, self.share, self.part_columns)
            return y
        slots, seg = self.a.shape[0] // self.share, batch.segments()
        a = self.a.view(slots, self.share, -1)[seg.lo:seg.hi]
        b = self.b_t.view(slots, self.share, -1)[seg.lo:seg.hi]
        shrink = torch.bmm(x.to(a.dtype)[seg.gather], a.transpose(1, 2))
        delta = torch.bmm(shrink, b).flatten(0, 1).index_select(0, seg.kept)
        return y.index_add_(0, seg.targets, delta.to(y.dtype))
