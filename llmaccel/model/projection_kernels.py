"""Which kernel runs each CPU projection of a loaded model, at which rows, in which weight layout: the bf16
projections' choice (ops/kernel_choice.tune_bf16) and the INT8/INT4/K-quant ones' (tune_quantized), timed on the
first layer's shapes (every layer has the same) and cached per machine and shape.

Where the choice is known before the weights are read (the cached timing, or a forced kernel), the load writes
each bf16 matrix straight into the chosen layout (`plan_bf16_before_reading`): read from the file into a scratch
buffer a matrix at a time and packed from there into the mapping a step streams. Read into a plain mapping first
and packed after, an 8B shape's load wrote 14.8 GB of plain pages beside the 11 GB it kept, peaked 15.4 GB, and
left so little memory for the page cache that a second start read most of its file from disk again.

model/causal_lm.py imports this module, so a model here is an nn.Module (a CausalLM: `spec`, `layers`, `lm_head`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from llmaccel.model.layers import Linear, weight_bytes
from llmaccel.model.weight_arena import LoadArena, return_freed_memory
from llmaccel.ops.kernel_choice import Bf16Choice, cached_bf16_choice, tune_bf16, tune_quantized
from llmaccel.ops.kquant_linear import ConcatLinear, KQuantLinear
from llmaccel.ops.quant_linear import Int4Linear, Int8Linear


class PackingLoader(Protocol):
    """What plan_bf16_before_reading sets on the load's model/causal_lm.WeightLoader (not imported: it imports
    this module): the layout each matrix it reads next is moved into, and where."""

    packing: tuple[Bf16Choice, LoadArena | None] | None


def _all_projections(model: nn.Module) -> list[nn.Module]:
    return [m for layer in model.layers for m in layer.projections]


DECODE_TIMING_BYTES = 256 << 20  # weights a decode-bucket timing streams: far past any L3, whatever the depth


def _streamed_layers(model: nn.Module) -> list[nn.Module]:
    """The projections of the first layers whose weights add up to DECODE_TIMING_BYTES (all of a small model's):
    a decode step's weights stream from memory, so its kernels are timed on more than the caches hold, but every
    layer has the same shapes, so timing all of a deep model's (8 GB a pass at 8B) taught nothing more."""
    return _all_projections(model)[:decode_timing_count(model.layers[0], len(model.layers))]


def decode_timing_count(first_layer: nn.Module, num_layers: int) -> int:
    """How many projections _streamed_layers gives for a model of `num_layers` layers like `first_layer`: those of
    the fewest layers whose weights reach DECODE_TIMING_BYTES (a load knows it from the first layer alone)."""
    per_layer = sum(weight_bytes(m) for m in first_layer.projections)
    layers = min(num_layers, max(1, -(-DECODE_TIMING_BYTES // max(per_layer, 1))))
    return layers * len(first_layer.projections)


def _compact_room(plain_bytes: int) -> int:
    """The bytes a compact arena holds for a weight of `plain_bytes`: its compact copy is smaller (~0.76 of them),
    and each starts on the arena's next aligned edge."""
    return plain_bytes + 2 * LoadArena.ALIGN


@dataclass(frozen=True)
class Bf16Plan:
    """The bf16 choice known before the weights were read: the layers' and the LM head's, the shapes it was found
    by (layer projections', head's; checked against the built model), and the mapping the packed weights went into."""

    layers: Bf16Choice
    head: Bf16Choice | None
    shapes: tuple[tuple[tuple[int, int], ...], tuple[int, int] | None]
    arena: LoadArena | None

    def head_packing(self) -> tuple[Bf16Choice, LoadArena | None] | None:
        """What WeightLoader.packing is while the LM head is read: its layout, where that is not the plain one."""
        return (self.head, self.arena) if self.head is not None and self.head.layout != "plain" else None


def plan_bf16_before_reading(model: nn.Module, take: PackingLoader, first_layer: nn.Module,
                             head_shape: tuple[int, int] | None, invariant: bool = False,
                             layout: str | None = None) -> Bf16Plan | None:
    """Where the first layer's projections are plain bf16 read in place (WeightLoader.placed) and the choice for
    the model's shapes is known without timing (ops/kernel_choice.cached_bf16_choice; `head_shape`: the plain bf16
    LM head the model will build, or None): moves that layer into the chosen layout and has `take` write every
    later projection straight into it (WeightLoader.packing). None otherwise: every weight is read plain and
    choose_bf16_kernels times (or looks up) the choice once the model is built."""
    modules = list(first_layer.projections)
    if not modules or not all(isinstance(m, Linear) and m.weight is not None and m.is_bf16
                              and LoadArena.holding([m.weight]) is not None for m in modules):
        return None
    shapes = tuple((m.out_features, m.in_features) for m in modules)
    known = cached_bf16_choice(list(shapes), head_shape, decode_timing_count(first_layer, model.spec.num_layers),
                               invariant, layout)
    if known is None or known[0] is None:
        return None
    layers, head = known
    arena = None
    if "compact" in (layers.layout, head.layout if head is not None else None):
        per_layer = sum(_compact_room(m.weight.nbytes) for m in modules) if layers.layout == "compact" else 0
        head_bytes = (_compact_room(2 * head_shape[0] * head_shape[1])
                      if head is not None and head.layout == "compact" else 0)
        arena = LoadArena(per_layer * model.spec.num_layers + head_bytes)
    for m in modules:
        m.set_bf16_choice(layers, arena)
    take.packing = (layers, arena) if layers.layout != "plain" else None
    return Bf16Plan(layers, head, (shapes, head_shape), arena)


def choose_bf16_kernels(model: nn.Module, invariant: bool = False, layout: str | None = None,
                        plan: Bf16Plan | None = None) -> LoadArena | None:
    """Times the bf16 kernels on the model's own projections (or reads the cached timing) and gives every
    plain bf16 Linear its choice, in the choice's layout: the layers one, the LM head its own
    (ops/kernel_choice.py); `invariant`: among the batch-invariant kernels only. A tied embedding table is the
    head's weight: it reads its rows in that layout. `plan`: the choice found before the weights were read, most
    of them already in its layout. Returns the arena the compact layout's weights were written into
    (_compact_arena), or None: the caller keeps it until the decode stack has looked there."""
    if plan is not None:
        return _apply_plan(model, plan)
    modules = tuple(model.layers[0].projections)
    plain = all(isinstance(m, Linear) and m.weight is not None and m.weight.dtype == torch.bfloat16 for m in modules)
    head = model.lm_head if isinstance(model.lm_head, Linear) and model.lm_head.weight is not None else None
    if head is not None and head.weight.dtype != torch.bfloat16:
        head = None
    if not plain and head is None:
        return None
    every = ([m.weight for m in _streamed_layers(model) if isinstance(m, Linear) and m.weight is not None]
             if plain else [])
    layers_choice, head_choice = tune_bf16([m.weight for m in modules] if plain else [],
                                           head.weight if head is not None else None, every, invariant, layout)
    return_freed_memory()  # the timing's heap (references, layout copies) before the arena below takes fresh pages
    moves = [(m, layers_choice) for m in _all_projections(model)] if layers_choice is not None else []
    moves += [(head, head_choice)] if head is not None else []
    arena = _compact_arena([m for m, choice in moves if choice.layout == "compact" and m.weight is not None])
    for m, choice in moves:
        m.set_bf16_choice(choice, arena)
    return arena


def _apply_plan(model: nn.Module, plan: Bf16Plan) -> LoadArena | None:
    """Gives every projection and the LM head the plan's choice (moving any weight still plain into its layout),
    once the built model is found to have the shapes the plan was looked up by."""
    head = model.lm_head if isinstance(model.lm_head, Linear) and model.lm_head.is_bf16 else None
    shapes = (tuple((m.out_features, m.in_features) for m in model.layers[0].projections),
              (head.out_features, head.in_features) if head is not None else None)
    if shapes != plan.shapes:
        raise RuntimeError(f"the bf16 kernel choice was looked up for projections and an LM head of {plan.shapes} "
                           f"before the weights were read, but the model built has {shapes}")
    for m in _all_projections(model):
        m.set_bf16_choice(plan.layers, plan.arena)
    if head is not None:
        head.set_bf16_choice(plan.head, plan.arena)
    return plan.arena


def _compact_arena(modules: list[Linear]) -> LoadArena | None:
    """A mapping for these plain weights' compact copies, written in place as each is packed (in the order a step
    reads them), so the decode stack finds nothing to copy: each takes ~0.76 of its plain bytes, and the mapping
    is sized at the plain bytes, whose untouched tail never becomes resident. Packed into memory of their own and
    copied into the decode stack's mapping, an 8B shape's weights filled 11 GB of fresh pages twice, which the
    kernel zeroes first (a third of a load's time on a 2-core VM)."""
    if not modules:
        return None
    return LoadArena(sum(_compact_room(m.weight.nbytes) for m in modules))


def unify_bf16_kernels(model: nn.Module, rows: int) -> None:
    """Every bf16 projection (and the decode stack) runs the one-row kernel from 1 to `rows` rows
    (Bf16Choice.lone_kernel_to). Speculative decoding asks this for 1 + K rows: verifying a lone request's
    drafts then rounds as decoding it without drafts does, whichever kernels the tuner chose."""
    for module in model.modules():
        if isinstance(module, Linear) and module.is_bf16:
            module.set_bf16_choice(module.bf16_choice.lone_kernel_to(rows))
    stack = model.decode_stack
    if stack is not None and isinstance(stack.choice, Bf16Choice):
        stack.choice = stack.choice.lone_kernel_to(rows)


def _in_blocks(module: nn.Module) -> bool:
    """INT8/INT4 blocks, K-quant records, or a fused projection of those: the AMX kernel reads them too."""
    return isinstance(module, Int8Linear | Int4Linear | KQuantLinear | ConcatLinear) and module.streams


def choose_quantized_kernels(model: nn.Module) -> None:
    """In a bfloat16 model, times the streaming and the AMX kernel on the projections in llmaccel's blocks
    (INT8, INT4, K-quants; or reads the cached timing) and gives each such module its batch choice: the
    layers' one (timed on the first layer's projections), the LM head its own (ops/kernel_choice.py). A
    K-quant head takes the layers' choice untimed: timing it reads the whole table back to float32 (1 GB
    at the 1B shape's vocabulary) for the reference check."""
    modules = list(model.layers[0].projections)
    layers = modules if all(_in_blocks(m) for m in modules) else []
    head = model.lm_head if _in_blocks(model.lm_head) else None
    kquant_head = isinstance(head, KQuantLinear)
    if not layers and head is None:
        return
    layers_choice, head_choice = tune_quantized(layers, None if kquant_head else head)
    if layers_choice is not None:
        for m in _all_projections(model):
            if _in_blocks(m):
                m.batch_choice = layers_choice
    if head is not None:
        head.batch_choice = layers_choice if kquant_head else head_choice
