"""LayerTaps: the residual stream after chosen layers, at chosen rows, read during a forward pass.

The semantic input guard (safety/semantic_guard.py) pools these over a prompt. A layer's output is its
`hidden` not yet added to the residual stream (model/causal_lm.py), so the stream there is
`hidden + residual`, taken before the next layer's fused add-norm writes over either.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LayerTaps:
    layers: tuple[int, ...]  # 0-based layer indices, ascending
    rows: torch.Tensor | None = None  # row indices of the batch to read; None: every row
    stop: bool = False  # end the pass after the last tapped layer (a truncated pass: the forward returns None)
    taken: list[torch.Tensor] = field(default_factory=list)  # one [rows, hidden] float32 per tapped layer

    def __post_init__(self) -> None:
        if not self.layers or list(self.layers) != sorted(set(self.layers)) or self.layers[0] < 0:
            raise ValueError(f"tapped layers must be distinct, ascending and >= 0, got {self.layers}")

    @property
    def last(self) -> int:
        return self.layers[-1]

    def take(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        if self.rows is not None:
            hidden = hidden.index_select(0, self.rows)
            residual = residual.index_select(0, self.rows) if residual is not None else None
        stream = hidden.float() if residual is None else hidden.float() + residual.float()
        self.taken.append(stream)

    def features(self) -> torch.Tensor:
        """[rows, len(layers) * hidden]: the tapped layers' streams side by side, in layer order."""
        return torch.cat(self.taken, dim=-1)
