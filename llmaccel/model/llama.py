"""The Llama family (Llama, Mistral, Qwen2, SmolLM2): RMSNorm, RoPE, grouped-query attention, SwiGLU.

Its layers are the shape the C++ decode stack and the fused decode attention run (model/decode_stack.py);
Phi-3 loads into the same layers, Qwen3 and Gemma extend them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from llmaccel.model.causal_lm import CausalLM, WeightLoader
from llmaccel.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from llmaccel.model.spec import ModelSpec, llama_spec
from llmaccel.ops.attention import AttentionMetadata, PagedAttention


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

    @property
    def projections(self) -> tuple[nn.Module, ...]:
        return self.qkv, self.o, self.mlp.gate_up, self.mlp.down

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rotary: RotaryEmbedding, attention: PagedAttention, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns this layer's (MLP output, residual): each residual add is folded into the norm that
        follows it (vLLM's fused_add_rms_norm)."""
        if residual is None:
            residual, hidden = hidden, self.input_norm(hidden)
        else:
            hidden, residual = self.input_norm.add_forward(hidden, residual)
        attn = self.attend(self.qkv(hidden), positions, rotary, attention, kv_cache, meta)
        hidden, residual = self.post_norm.add_forward(self.o(attn), residual)
        return self.mlp(hidden), residual

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
               attention: PagedAttention, kv_cache: tuple[torch.Tensor, torch.Tensor],
               meta: AttentionMetadata) -> torch.Tensor:
        """Attention from the fused projection qkv [T, (H + 2 KVH) D]: [T, H D]."""
        num_tokens = qkv.shape[0]
        attn = attention.fused_decode(qkv, positions, rotary.cos, rotary.sin, kv_cache[0], kv_cache[1], meta,
                                      self.window)
        if attn is None:
            q, k = rotary.rotate(positions, qkv, self.num_heads, self.num_kv_heads, self.head_dim)
            v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
            attn = attention.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.window)
        return attn.reshape(num_tokens, self.q_size)


class LlamaForCausalLM(CausalLM):
    uses_decode_stack = True

    @classmethod
    def read_spec(cls, config: dict, source: str) -> ModelSpec:
        from llmaccel.model.registry import resolve_architecture

        arch = resolve_architecture(config, source)
        model_type = {"MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}.get(arch, "llama")
        return llama_spec({**config, "model_type": model_type}, source, arch)

    def build_layer(self, i: int, take: WeightLoader) -> nn.Module:
        return decoder_layer(self.spec, i, take)


def decoder_layer(spec: ModelSpec, i: int, take: WeightLoader,
                  make: Callable[..., DecoderLayer] = DecoderLayer) -> DecoderLayer:
    """Layer `i` from the checkpoint's HF-named weights, each projection built by `take.linear` (dense,
    quantized or prequantized: the loader's choice); `make` builds the layer (a family's own subclass)."""
    p = f"model.layers.{i}."
    qkv_bias = take.cat([p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias",
                         p + "self_attn.v_proj.bias"]) if spec.qkv_bias else None
    qkv = take.linear([p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"],
                      qkv_bias, p + "self_attn.qkv")
    o = take.linear([p + "self_attn.o_proj.weight"], take(p + "self_attn.o_proj.bias") if spec.o_bias else None,
                    p + "self_attn.o_proj")
    gate_up_bias = take.cat([p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"]) if spec.mlp_bias else None
    down_bias = take(p + "mlp.down_proj.bias") if spec.mlp_bias else None
    gate_up = take.linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], gate_up_bias, p + "mlp.gate_up")
    mlp = GatedMLP(gate_up, take.linear([p + "mlp.down_proj.weight"], down_bias, p + "mlp.down_proj"))
    input_norm = take.norm(p + "input_layernorm.weight", spec.rms_norm_eps)
    post_norm = take.norm(p + "post_attention_layernorm.weight", spec.rms_norm_eps)
    return make(spec, qkv, o, mlp, input_norm, post_norm, spec.layer_window(i))
