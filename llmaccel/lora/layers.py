"""Many LoRA adapters in one batch: each projection's adapters stacked, applied to every row in two matmuls.

As S-LoRA / Punica batch them, with the gather done by a mask: every loaded adapter owns a share of
`parts x max_rank` columns in the projection's stacked A (`[max_loras * share, in]`) and B^T
(`[max_loras * share, out]`, the scaling folded in; block-diagonal where q, k and v, or gate and up, are fused).
For a step whose rows carry adapters:

    shrink = x @ A[lo:hi]^T           one matmul over the shares of the adapters in the step (lo..hi)
    shrink *= mask                    each row keeps its own adapter's columns (zero for a row without one)
    y = base(x) + shrink @ B^T[lo:hi] one more

so requests for different adapters (and the base model) share the step's base matmul and two small ones,
instead of a pass per adapter. A step with no adapter rows runs the base projection alone (bit-identical to a
model served without LoRA); a zero column adds an exact zero, so a row without an adapter is its base row.
"""

from __future__ import annotations

import torch
from torch import nn

from llmaccel.lora.adapter import PARTS, LoRAPiece


class LoRABatch:
    """Which adapter slot each row of the current forward pass uses (set by the runner before each pass)."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.rows: torch.Tensor | None = None  # [rows] slot index, -1 for the base model; None: no adapter rows
        self.lo = self.hi = 0  # the slots of the step's adapters lie in lo..hi-1
        self._masks: dict[int, torch.Tensor] = {}

    def set_rows(self, slots: list[int]) -> None:
        used = {s for s in slots if s >= 0}
        self._masks.clear()
        if not used:
            self.rows = None
            return
        self.lo, self.hi = min(used), max(used) + 1
        self.rows = torch.tensor(slots, device=self.device)

    @property
    def active(self) -> bool:
        return self.rows is not None

    def mask(self, share: int) -> torch.Tensor:
        """[rows, (hi - lo) * share]: 1 where a column belongs to the row's own adapter, shared by every projection
        with this share width in the pass."""
        mask = self._masks.get(share)
        if mask is None:
            columns = torch.arange(self.lo * share, self.hi * share, device=self.device) // share
            mask = self._masks[share] = (self.rows[:, None] == columns[None, :]).to(self.dtype)
        return mask


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

    @property
    def weight_bytes(self) -> int:
        from llmaccel.model.layers import weight_bytes

        return weight_bytes(self.base) + (self.a.numel() + self.b_t.numel()) * self.a.element_size()

    def load(self, slot: int, piece: LoRAPiece) -> None:
        rank, rows = piece.a.shape[0], piece.b.shape[0]
        first = slot * self.share + piece.part * self.max_rank
        self.a[first:first + rank] = piece.a.to(self.a.device)
        self.b_t[first:first + rank, piece.row_start:piece.row_start + rows] = piece.b.t().to(self.a.device)

    def clear(self, slot: int) -> None:
        self.a[slot * self.share:(slot + 1) * self.share] = 0
        self.b_t[slot * self.share:(slot + 1) * self.share] = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.batch
        if batch.rows is None:
            return y
        lo, hi = batch.lo * self.share, batch.hi * self.share
        shrink = torch.nn.functional.linear(x.to(self.a.dtype), self.a[lo:hi])
        shrink.mul_(batch.mask(self.share))
        return y.addmm_(shrink.to(y.dtype), self.b_t[lo:hi].to(y.dtype))
