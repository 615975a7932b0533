"""The Llama family (Llama, Mistral, Qwen2, SmolLM2) on a flattened batch with paged KV.

The model sees `[total_tokens, hidden]`; attention metadata says which tokens belong to whom and
where their keys and values live in the pool. The LM head runs only on the rows that are sampled.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from llmaccel.model.decode_stack import build_decode_stack
from llmaccel.model.layers import Embedding, GatedMLP, Linear, RMSNorm, RotaryEmbedding, build_linear
from llmaccel.model.spec import ModelSpec
from llmaccel.ops.attention import AttentionMetadata, PagedAttention
from llmaccel.ops.kernel_choice import Bf16Choice, tune_bf16, tune_quantized
from llmaccel.ops.quant_linear import Int4Linear, Int8Linear, quantized_linear
from llmaccel.quantization.formats import Int4Weight, Int8Weight, concat_weights, quantize_int8, same_format


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, qkv: nn.Module, o: nn.Module, mlp: GatedMLP, input_norm: RMSNorm,
                 post_norm: RMSNorm, window: int | None) -> None:
        super().__init__()
        self.window = window  # sliding-window attention, or None
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.qkv, self.o, self.mlp = qkv, o, mlp
        self.input_norm, self.post_norm = input_norm, post_norm

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rotary: RotaryEmbedding, attention: PagedAttention, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden`: the previous layer's MLP output, not yet added to the residual stream `residual` (None
        at the first layer: `hidden` is the embedding). Returns this layer's (MLP output, residual):
        each residual add is folded into the norm that follows it (vLLM's fused_add_rms_norm)."""
        num_tokens = hidden.shape[0]
        if residual is None:
            residual, hidden = hidden, self.input_norm(hidden)
        else:
            hidden, residual = self.input_norm.add_forward(hidden, residual)
        qkv = self.qkv(hidden)
        attn = attention.fused_decode(qkv, positions, rotary.cos, rotary.sin, kv_cache[0], kv_cache[1], meta,
                                      self.window)
        if attn is None:
            q, k = rotary.rotate(positions, qkv, self.num_heads, self.num_kv_heads, self.head_dim)
            v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
            attn = attention.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.window)
        hidden, residual = self.post_norm.add_forward(self.o(attn.reshape(num_tokens, self.q_size)), residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, weights: Mapping[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, max_positions: int, use_kernel: bool | None = None,
                 quantization: str | None = None, group_size: int | None = None,
                 prequantized: Mapping[str, Int4Weight | Int8Weight] | None = None,
                 quantize_embedding: bool = False) -> None:
        """`quantization` (int8 / int4) applies to every decoder linear layer. The embedding and the LM
        head stay in `dtype` (mixed precision, as weight-only schemes recommend) unless
        `quantize_embedding`: then they are INT8 per row, and a tied pair shares one INT8 copy.
        `prequantized` gives ready INT8/INT4 weights by tensor name (a GGUF file's own, or a saved
        quantized checkpoint's), used as they are where present."""
        super().__init__()
        self.spec = spec
        take = _WeightTaker(weights, dtype, device)
        prequantized = prequantized or {}

        def linear(names: list[str], bias: torch.Tensor | None, name: str) -> nn.Module:
            ready = [prequantized.get(n) for n in names]
            if all(w is not None for w in ready) and same_format(ready):
                return quantized_linear(concat_weights(ready), bias, device)
            return build_linear(take.cat(names), bias, quantization, group_size, name)

        def int8_table(name: str) -> nn.Module:
            ready = prequantized.get(name)
            return quantized_linear(ready if isinstance(ready, Int8Weight) else quantize_int8(take(name)), None, device)

        tied = spec.tie_word_embeddings or not ("lm_head.weight" in weights or "lm_head.weight" in prequantized)
        if quantize_embedding or "model.embed_tokens.weight" in prequantized:
            self.embedding = int8_table("model.embed_tokens.weight")
        elif tied:  # one copy serves both where the layout can be read by rows
            table = Linear(take("model.embed_tokens.weight"))
            self.embedding = table if table.has_rows else Embedding(take("model.embed_tokens.weight"))
        else:
            self.embedding = Embedding(take("model.embed_tokens.weight"))
        layers = [decoder_layer(spec, i, take, linear) for i in range(spec.num_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.norm.weight.data = take("model.norm.weight")
        if tied:
            self.lm_head = table if isinstance(self.embedding, Embedding) else self.embedding
        elif isinstance(self.embedding, Embedding):
            self.lm_head = Linear(take("lm_head.weight"))
        else:
            self.lm_head = int8_table("lm_head.weight")
        self.rotary = RotaryEmbedding(spec.head_dim, max_positions, spec.rope_theta, spec.rope_scaling,
                                      dtype).to(device)
        self.attention = PagedAttention(spec.num_heads, spec.num_kv_heads, spec.head_dim, device, use_kernel)
        if device.type == "cpu" and dtype == torch.bfloat16 and use_kernel is not False:
            choose_bf16_kernels(self)
            choose_quantized_kernels(self)
        # decode-only steps in one C++ call where the weights allow (model/decode_stack.py); None: layer by layer
        self.decode_stack = build_decode_stack(self) if device.type == "cpu" and use_kernel is not False else None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        if self.decode_stack is not None:
            normed = self.decode_stack.decode(self, input_ids, positions, meta, kv_caches)
            if normed is not None:
                return normed
        # an INT8 table's rows come back in float32: the stream runs in the model's dtype
        hidden, residual = self.embedding.rows(input_ids).to(self.norm.weight.dtype), None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, positions, self.rotary, self.attention, kv_cache, meta)
        return self.norm.add_forward(hidden, residual)[0] if residual is not None else self.norm(hidden)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits; an INT8/INT4 head's kernel sums in float32 and hands them over unrounded."""
        if isinstance(self.lm_head, Int8Linear | Int4Linear):
            return self.lm_head.float_forward(hidden)
        return self.lm_head(hidden).float()


class _WeightTaker:
    """Pulls named tensors out of a checkpoint, cast and placed, naming any that are missing."""

    def __init__(self, weights: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> None:
        self.weights, self.dtype, self.device = weights, dtype, device

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.weights:
            from llmaccel.errors import CorruptCheckpointError

            raise CorruptCheckpointError(f"checkpoint has no tensor {name!r}")
        return self.weights[name].to(device=self.device, dtype=self.dtype).contiguous()

    def cat(self, names: list[str]) -> torch.Tensor:
        return torch.cat([self(n) for n in names], dim=0)


def decoder_layer(spec: ModelSpec, i: int, take: _WeightTaker,
                  linear: Callable[[list[str], torch.Tensor | None, str], nn.Module]) -> DecoderLayer:
    """Layer `i` from the checkpoint's HF-named weights; `linear(names, bias, name)` builds a projection
    from the named weights stacked (dense, quantized or prequantized: the caller's choice)."""
    p = f"model.layers.{i}."
    qkv_bias = take.cat([p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias",
                         p + "self_attn.v_proj.bias"]) if spec.qkv_bias else None
    qkv = linear([p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"],
                 qkv_bias, p + "self_attn.qkv")
    o = linear([p + "self_attn.o_proj.weight"], take(p + "self_attn.o_proj.bias") if spec.o_bias else None,
               p + "self_attn.o_proj")
    gate_up_bias = take.cat([p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"]) if spec.mlp_bias else None
    down_bias = take(p + "mlp.down_proj.bias") if spec.mlp_bias else None
    gate_up = linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], gate_up_bias, p + "mlp.gate_up")
    mlp = GatedMLP(gate_up, linear([p + "mlp.down_proj.weight"], down_bias, p + "mlp.down_proj"))
    input_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
    input_norm.weight.data = take(p + "input_layernorm.weight")
    post_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
    post_norm.weight.data = take(p + "post_attention_layernorm.weight")
    return DecoderLayer(spec, qkv, o, mlp, input_norm, post_norm, spec.layer_window(i))


def choose_bf16_kernels(model: LlamaForCausalLM) -> None:
    """Times the bf16 kernels on the model's own projections (or reads the cached timing) and gives every
    plain bf16 Linear its choice, in the choice's layout: the layers one, the LM head its own
    (ops/kernel_choice.py). A tied embedding table is the head's weight: it reads its rows in that layout."""
    first = model.layers[0]
    modules = (first.qkv, first.o, first.mlp.gate_up, first.mlp.down)
    plain = all(isinstance(m, Linear) and m.weight is not None and m.weight.dtype == torch.bfloat16 for m in modules)
    head = model.lm_head if isinstance(model.lm_head, Linear) and model.lm_head.weight is not None else None
    if head is not None and head.weight.dtype != torch.bfloat16:
        head = None
    if not plain and head is None:
        return
    every = [m.weight for layer in model.layers for m in (layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down)
             if isinstance(m, Linear) and m.weight is not None] if plain else []
    layers_choice, head_choice = tune_bf16([m.weight for m in modules] if plain else [],
                                           head.weight if head is not None else None, every)
    if layers_choice is not None:
        for layer in model.layers:
            for m in (layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down):
                m.set_bf16_choice(layers_choice)
    if head is not None:
        head.set_bf16_choice(head_choice)


def unify_bf16_kernels(model: LlamaForCausalLM, rows: int) -> None:
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
    return isinstance(module, Int8Linear | Int4Linear) and module.streams


def choose_quantized_kernels(model: LlamaForCausalLM) -> None:
    """In a bfloat16 model, times the streaming and the AMX kernel on the INT8/INT4 projections in
    llmaccel's blocks (or reads the cached timing) and gives each such module its batch choice: the
    layers' one (timed on the first layer's projections), the LM head its own (ops/kernel_choice.py)."""
    first = model.layers[0]
    modules = [first.qkv, first.o, first.mlp.gate_up, first.mlp.down]
    layers = modules if all(_in_blocks(m) for m in modules) else []
    head = model.lm_head if _in_blocks(model.lm_head) else None
    if not layers and head is None:
        return
    layers_choice, head_choice = tune_quantized(layers, head)
    if layers_choice is not None:
        for layer in model.layers:
            for m in (layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down):
                if _in_blocks(m):
                    m.batch_choice = layers_choice
    if head is not None:
        head.batch_choice = head_choice
