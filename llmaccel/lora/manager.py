"""The LoRA adapters a served model holds: a slot each (up to --max-loras), loaded and unloaded between steps.

At start every decoder projection of the model is wrapped in a LoRALinear (lora/layers.py) whose stacked matrices
have a share per slot; loading an adapter writes its A and B into its slot's share, unloading zeroes it. The
engine calls these between steps (its thread), so no pass ever sees half an adapter.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from llmaccel.config import LoRAConfig
from llmaccel.lora.adapter import AdapterError, LoRAAdapter, part_rows, read_adapter
from llmaccel.lora.layers import LoRABatch, LoRALinear

logger = logging.getLogger(__name__)

def _projections(layer: nn.Module) -> dict[str, tuple[nn.Module, str]] | None:
    """A Llama-shaped layer's projections, as (owner, attribute), or None for a layer of another shape."""
    mlp = getattr(layer, "mlp", None)
    if not all(hasattr(layer, a) for a in ("qkv", "o")) or mlp is None or not hasattr(mlp, "gate_up"):
        return None
    return {"qkv": (layer, "qkv"), "o": (layer, "o"), "gate_up": (mlp, "gate_up"), "down": (mlp, "down")}


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.spec = model.spec
        self.max_loras, self.max_rank = config.max_loras, config.max_lora_rank
        self.dtype = dtype
        self.batch = LoRABatch(device, dtype)
        spec = model.spec
        rows = part_rows(spec)  # each projection's (in, out) is its whole PEFT target's (width, rows)
        widths = {name: (rows[target][2], rows[target][1]) for name, target in
                  (("qkv", "qkv_proj"), ("o", "o_proj"), ("gate_up", "gate_up_proj"), ("down", "down_proj"))}
        self.modules: list[dict[str, LoRALinear]] = []
        for i, layer in enumerate(model.layers):
            places = _projections(layer)
            if places is None:
                raise AdapterError(f"LoRA adapters need a Llama-shaped model (q/k/v, o, gate/up and down "
                                   f"projections); layer {i} of this {spec.architecture} has another shape")
            wrapped = {}
            for name, (owner, attribute) in places.items():
                in_features, out_features = widths[name]
                wrapped[name] = LoRALinear(getattr(owner, attribute), self.batch, name, self.max_loras, self.max_rank,
                                           in_features, out_features)
                setattr(owner, attribute, wrapped[name])
            self.modules.append(wrapped)
        model.adapters = self.batch  # each step's rows' adapters, for the layers and the decode stack
        if getattr(model, "decode_stack", None) is not None:  # decode steps with adapter rows stay in the stack
            model.decode_stack.set_lora(self.modules)
        self.adapters: dict[str, LoRAAdapter] = {}
        self.slots: dict[str, int] = {}
        extra = sum(m.a.nbytes + m.b_t.nbytes for layer in self.modules for m in layer.values())
        logger.info("LoRA: room for %d adapters of rank <= %d (%.0f MB of stacked matrices)", self.max_loras,
                    self.max_rank, extra / 1e6)
        for name, path in config.lora_modules:
            self.add(name, path)

    def add(self, name: str, path: str) -> LoRAAdapter:
        """Load the adapter at `path` as `name` into a free slot; AdapterError (nothing changed) if it cannot be."""
        if name in self.adapters:
            raise AdapterError(f"a LoRA adapter named {name!r} is already loaded (from {self.adapters[name].path}); "
                               "unload it first")
        free = next((s for s in range(self.max_loras) if s not in self.slots.values()), None)
        if free is None:
            raise AdapterError(f"{self.max_loras} LoRA adapters are loaded (--max-loras): unload one before loading "
                               f"{name!r}")
        adapter = read_adapter(name, path, self.spec, self.max_rank, self.dtype)
        for piece in adapter.pieces:
            self.modules[piece.layer][piece.module].load(free, piece)
        self.adapters[name], self.slots[name] = adapter, free
        logger.info("LoRA adapter %r loaded from %s: rank %d, %d projections, slot %d", name, adapter.path,
                    adapter.rank, len(adapter.pieces), free)
        return adapter

    def remove(self, name: str) -> None:
        if name not in self.adapters:
            raise AdapterError(f"no LoRA adapter named {name!r} is loaded"
                               + (f" (loaded: {', '.join(sorted(self.adapters))})" if self.adapters else ""))
        slot = self.slots.pop(name)
        del self.adapters[name]
        for layer in self.modules:
            for module in layer.values():
                module.clear(slot)
        logger.info("LoRA adapter %r unloaded (slot %d)", name, slot)

    def slot(self, name: str) -> int:
        return self.slots[name]

    def set_rows(self, slots: list[int]) -> None:
        """The adapter slot of each row of the next forward pass (-1: the base model)."""
        self.batch.set_rows(slots)
