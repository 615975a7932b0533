"""Qwen3: the Llama layer with an RMSNorm over each head of q and k before RoPE (no q/k/v bias)."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from llmaccel.model.causal_lm import CausalLM, WeightLoader
from llmaccel.model.layers import RMSNorm, RotaryEmbedding
from llmaccel.model.llama import DecoderLayer, decoder_layer
from llmaccel.model.spec import ModelSpec, llama_spec
from llmaccel.ops.attention import AttentionMetadata, PagedAttention


def norm_heads_(qkv: torch.Tensor, q_norm: nn.Module, k_norm: nn.Module, num_heads: int, num_kv_heads: int,
                head_dim: int) -> None:
    """Normalise every query and key head of the fused projection qkv [T, (H + 2 KVH) D] in place."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv[:, :q_size] = q_norm(qkv[:, :q_size].reshape(-1, head_dim)).view(-1, q_size)
    qkv[:, q_size:q_size + kv_size] = k_norm(qkv[:, q_size:q_size + kv_size].reshape(-1, head_dim)).view(-1, kv_size)


class Qwen3DecoderLayer(DecoderLayer):
    def __init__(self, *args, q_norm: RMSNorm, k_norm: RMSNorm) -> None:
        super().__init__(*args)
        self.q_norm, self.k_norm = q_norm, k_norm

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
               attention: PagedAttention, kv_cache: tuple[torch.Tensor, torch.Tensor],
               meta: AttentionMetadata) -> torch.Tensor:
        norm_heads_(qkv, self.q_norm, self.k_norm, self.num_heads, self.num_kv_heads, self.head_dim)
        return super().attend(qkv, positions, rotary, attention, kv_cache, meta)


class Qwen3ForCausalLM(CausalLM):
    uses_decode_stack = True  # the stack normalises q and k heads before RoPE, as attend does
    @classmethod
    def read_spec(cls, config: dict, source: str) -> ModelSpec:
        return llama_spec({**config, "model_type": "qwen3"}, source, "Qwen3ForCausalLM", qk_norm=True)

    def build_layer(self, i: int, take: WeightLoader) -> nn.Module:
        p, eps = f"model.layers.{i}.self_attn.", self.spec.rms_norm_eps
        norms = dict(q_norm=take.norm(p + "q_norm.weight", eps), k_norm=take.norm(p + "k_norm.weight", eps))
        return decoder_layer(self.spec, i, take, partial(Qwen3DecoderLayer, **norms))
