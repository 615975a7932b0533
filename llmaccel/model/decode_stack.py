"""The decoder stack's decode step in one C++ call (ops/csrc/decode_stack.cpp).

A decode-only step on the CPU (float32 or bfloat16 activations) runs every layer (norms, projections, RoPE, KV
write, paged attention, gated MLP) inside one parallel region instead of ~15 Python-level calls a
layer: on the default model that Python cost 6-7 ms a token, half of an INT8 token's time. The
arithmetic is the same kernels' in the same order, so the hidden states are bit-identical to the
layer-by-layer path, which still serves prefill, mixed steps and anything the stack cannot read
(tests/test_decode_stack.py holds the two to each other).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from llmaccel.model.layers import Linear
from llmaccel.model.step_interrupt import StepInterrupt, StepInterrupted
from llmaccel.model.weight_arena import WeightArena
from llmaccel.ops.cpu_kernels import load_cpu_kernels
from llmaccel.ops.gemv import gemv_kernels
from llmaccel.ops.kernel_choice import Bf16Choice
from llmaccel.ops.kquant_linear import ConcatLinear, KQuantLinear
from llmaccel.ops.layer_ops import layer_kernels
from llmaccel.ops.quant_linear import Int4Linear, Int8Linear

if TYPE_CHECKING:
    from llmaccel.ops.attention import AttentionMetadata

logger = logging.getLogger(__name__)
# `model` below is a CausalLM (model/causal_lm.py), typed as the nn.Module it is: causal_lm imports this
# module to build the stack, and a file never imports one that imports it


def stack_linear(kernels, module: nn.Module):
    """The module's weights as the stack reads them, or None where their layout is not one it reads."""
    bias = getattr(module, "bias", None)
    if isinstance(module, ConcatLinear):
        parts = [stack_linear(kernels, part) for part in module.parts]
        return None if any(p is None for p in parts) else kernels.fused_linear(parts, bias)
    if isinstance(module, KQuantLinear):
        return kernels.stack_linear(module.layout, module.blocks, None, bias, module.out_features)
    if isinstance(module, Linear) and module.panels is not None:  # float32, or bf16 / f16 widened as read
        return kernels.stack_linear("f32", module.panels, None, bias, module.out_features)
    if isinstance(module, Linear) and module.vnni is not None:
        return kernels.stack_linear("bf16_vnni", module.vnni, None, bias, module.out_features)
    if isinstance(module, Linear) and module.compact is not None:
        return kernels.stack_linear("bf16_compact", module.compact, None, bias, module.out_features)
    if (isinstance(module, Linear) and module.weight is not None and module.weight.dtype == torch.bfloat16
            and module.weight.device.type == "cpu"):
        return kernels.stack_linear("bf16", module.weight, None, bias, module.out_features)
    if isinstance(module, Int8Linear) and module.streams:
        return kernels.stack_linear("int8", module.blocks, module.row_scale, bias, module.out_features)
    if isinstance(module, Int4Linear) and module._gemv is not None:
        return kernels.stack_linear("int4", module.blocks, None, bias, module.out_features)
    return None


class DecodeStack:
    """The C++ stack holding a model's layers (`stack`); it takes decode-only steps in the model's dtype.
    The kernel `choice` names for the step's rows runs the projections (the layers' own choice,
    ops/kernel_choice.py). Plain bfloat16 weights: the streaming kernel or the AVX512-BF16 GEMM inside
    the stack's one parallel region, or oneDNN GEMMs between its phases; weights packed for AMX stream or
    run oneDNN's brgemm inside the region; INT8/INT4 weights in a bfloat16 model stream or are dequantized
    for brgemm. None: always the streaming kernels."""

    def __init__(self, stack, dtype: torch.dtype, choice: Bf16Choice | None) -> None:
        self.stack, self.dtype, self.choice = stack, dtype, choice
        self.lora = False  # whether every projection holds its LoRA adapters (set_lora): then steps with adapter
        # rows decode here too, each row's delta added in C++ (csrc/lora.h)

    def set_lora(self, layers: list[dict[str, nn.Module]]) -> None:
        """Every layer's projections (qkv, o, gate_up, down) add the deltas of their LoRALinear's adapters; where the
        stack cannot take one, steps with adapter rows decode layer by layer (the reason logged)."""
        try:
            for i, modules in enumerate(layers):
                for index, name in enumerate(("qkv", "o", "gate_up", "down")):
                    m = modules[name]
                    self.stack.set_lora(i, index, m.a, m.b_t, m.share, m.part_columns)
        except RuntimeError as exc:
            logger.info("the decode stack cannot take the LoRA adapters (%s); steps with adapter rows decode layer "
                        "by layer", str(exc).splitlines()[0])
            return
        self.lora = True

    def decode(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
               interrupt: StepInterrupt | None = None) -> torch.Tensor | None:
        """The final norm's output for a decode-only step, or None where the step is not one it takes.
        Raises StepInterrupted when `interrupt` was raised during the step (checked after every layer)."""
        rows = input_ids.shape[0]
        if meta.prefills or meta.num_decode_tokens != rows or kv_caches[0][0].dtype not in (self.dtype, torch.int8):
            return None
        adapters = getattr(model, "adapters", None)
        lora_slots = adapters.slots if adapters is not None and adapters.active else None
        if lora_slots is not None and not self.lora:
            return None
        hidden = model.embed(input_ids, positions).to(self.dtype)
        kernel = "stream" if self.choice is None else self.choice.kernel(rows)
        normed = self.stack.forward(hidden, positions, model.rotary.cos, model.rotary.sin,
                                    [kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches], meta.slot_mapping,
                                    meta.decode_block_tables, meta.decode_context_lens, meta.block_size, kernel,
                                    meta.decode_kv_first, lora_slots, None if interrupt is None else interrupt.flag)
        if normed.shape[0] != rows:  # it stopped after a layer: the interrupt was raised
            raise StepInterrupted
        return normed


def _layer_extras(layer: nn.Module) -> dict:
    """What a layer adds to Llama's, as the stack takes it: Qwen3's and Gemma 3's q/k norms, Gemma 2/3's norms
    around the MLP, Gemma 3's local rotary tables, Gemma's GeGLU."""
    def weight(name: str) -> torch.Tensor | None:
        norm = getattr(layer, name, None)
        return None if norm is None else norm.weight.data

    extras = {name: weight(name) for name in ("q_norm", "k_norm", "pre_mlp_norm", "post_mlp_norm")}
    local = getattr(layer, "local_rotary", None)
    extras.update(cos=None if local is None else local.cos, sin=None if local is None else local.sin,
                  activation=layer.mlp.activation)
    return extras


def build_decode_stack(model: nn.Module) -> DecodeStack | None:
    """The model's layers in a C++ stack, or None (the reason logged) where it does not apply."""
    kernels = load_cpu_kernels()
    if kernels is None or not hasattr(kernels, "DecodeStack") or gemv_kernels() is None or layer_kernels() is None:
        return None
    spec, dtype = model.spec, model.norm.weight.dtype
    if dtype not in (torch.float32, torch.bfloat16) or model.rotary.cos.dtype != dtype:
        return None
    streamed = [part for layer in model.layers for m in layer.projections
                for part in (m.parts if isinstance(m, ConcatLinear) else [m])]
    arena = WeightArena([*streamed, model.lm_head], model)  # the modules now hold views of it
    logger.info("decode weights: %.0f MB in %s%s", arena.nbytes / 1e6,
                "one mapping" if arena.mappings == 1 else f"{arena.mappings} mappings",
                " on huge pages" if arena.huge_pages else "")
    stack = kernels.DecodeStack(spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                                spec.rms_norm_eps, model.norm.weight.data, model.attention.scale,
                                model.attention.softcap or 0.0)
    for i, layer in enumerate(model.layers):
        modules = (layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down)
        parts = [stack_linear(kernels, m) for m in modules]
        if any(p is None for p in parts):
            logger.info("layer %d's weights are in a layout the decode stack does not read; "
                        "decoding layer by layer", i)
            return None
        try:  # the stack checks shapes, widths and dtypes itself
            stack.add_layer(*parts, layer.input_norm.weight.data, layer.post_norm.weight.data, layer.window or 0,
                            **_layer_extras(layer))
        except RuntimeError as exc:
            logger.info("the decode stack cannot take layer %d (%s); decoding layer by layer", i,
                        str(exc).splitlines()[0])
            return None
    # every layer's bf16 projections share the layers' kernel choice (model/projection_kernels.choose_bf16_kernels),
    # and so do its INT8/INT4 ones where every projection has one (choose_quantized_kernels)
    choice = next((m.bf16_choice for m in modules if isinstance(m, Linear) and m.is_bf16), None)
    quantized = [getattr(m, "batch_choice", None) for layer in model.layers
                 for m in (layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down)]
    if choice is None and quantized[0] is not None and all(c is quantized[0] for c in quantized):
        choice = quantized[0]
    return DecodeStack(stack, dtype, choice)
