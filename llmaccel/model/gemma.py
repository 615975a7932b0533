"""Gemma 1, 2 and 3: scaled embeddings, (1 + w) RMSNorms, GeGLU, tied head; Gemma 2 and 3 add norms after
attention and after the MLP, local sliding-window layers between global ones and a query scale of their own;
Gemma 2 soft-caps the attention scores and the logits, Gemma 3 normalises q and k per head and gives its
local layers a RoPE base of their own.
"""

from __future__ import annotations

import torch
from torch import nn

from llmaccel.errors import UnsupportedModelError
from llmaccel.model.causal_lm import CausalLM, WeightLoader
from llmaccel.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from llmaccel.model.llama import DecoderLayer
from llmaccel.model.qwen3 import norm_heads_
from llmaccel.model.spec import ModelSpec, config_fields, llama_spec, rope_parameters
from llmaccel.ops.attention import AttentionMetadata, PagedAttention

_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "gelu": "gelu_tanh"}


def _activation(config: dict, source: str) -> str:
    # HF's Gemma MLPs read `hidden_activation` (GeLU, tanh approximation); Gemma 1 configs also say "gelu"
    name = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if name not in _ACTIVATIONS:
        raise UnsupportedModelError(f"{source}: hidden_activation {name!r} is not supported; Gemma runs "
                                    "gelu_pytorch_tanh")
    return _ACTIVATIONS[name]


def _layer_types(config: dict, pattern: int, source: str) -> list[str]:
    """HF's default when config.json does not list them: every `pattern`-th layer global, the rest local."""
    with config_fields(source):
        count = int(config["num_hidden_layers"])
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(count)]


class GemmaDecoderLayer(DecoderLayer):
    """The Llama layer with GeGLU and (1 + w) norms (Gemma 1); with `sandwich` (Gemma 2, 3) the post-attention
    norm acts on the attention output and two more norms wrap the MLP; q/k norms where given (Gemma 3)."""

    def __init__(self, *args, sandwich: bool, pre_mlp_norm: RMSNorm | None = None,
                 post_mlp_norm: RMSNorm | None = None, q_norm: RMSNorm | None = None,
                 k_norm: RMSNorm | None = None) -> None:
        super().__init__(*args)
        self.sandwich = sandwich
        self.pre_mlp_norm, self.post_mlp_norm = pre_mlp_norm, post_mlp_norm
        self.q_norm, self.k_norm = q_norm, k_norm
        self.local_rotary: RotaryEmbedding | None = None  # Gemma 3's local layers rotate by their own base

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rotary: RotaryEmbedding, attention: PagedAttention, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.sandwich:
            return super().forward(hidden, residual, positions, rotary, attention, kv_cache, meta)
        if residual is None:
            residual, hidden = hidden, self.input_norm(hidden)
        else:
            hidden, residual = self.input_norm.add_forward(hidden, residual)
        attn = self.post_norm(self.o(self.attend(self.qkv(hidden), positions, rotary, attention, kv_cache, meta)))
        hidden, residual = self.pre_mlp_norm.add_forward(attn, residual)
        return self.post_mlp_norm(self.mlp(hidden)), residual

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
               attention: PagedAttention, kv_cache: tuple[torch.Tensor, torch.Tensor],
               meta: AttentionMetadata) -> torch.Tensor:
        if self.q_norm is not None:
            norm_heads_(qkv, self.q_norm, self.k_norm, self.num_heads, self.num_kv_heads, self.head_dim)
        return super().attend(qkv, positions, self.local_rotary or rotary, attention, kv_cache, meta)


class GemmaForCausalLM(CausalLM):
    uses_decode_stack = True  # GeGLU, the sandwich norms, q/k norms and local tables are in the stack too
    norm_offset = 1.0
    sandwich = False  # Gemma 2 and 3's four norms a layer
    qk_norm = False

    @classmethod
    def read_spec(cls, config: dict, source: str) -> ModelSpec:
        return llama_spec({**config, "model_type": "gemma", "sliding_window": None}, source, "GemmaForCausalLM",
                          hidden_act=_activation(config, source), tie_word_embeddings=True)

    def build_layer(self, i: int, take: WeightLoader) -> nn.Module:
        spec, p, eps = self.spec, f"model.layers.{i}.", self.spec.rms_norm_eps
        attn, mlp = p + "self_attn.", p + "mlp."
        qkv = take.linear([attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"], None,
                          attn + "qkv")
        o = take.linear([attn + "o_proj.weight"], None, attn + "o_proj")
        gated = GatedMLP(take.linear([mlp + "gate_proj.weight", mlp + "up_proj.weight"], None, mlp + "gate_up"),
                         take.linear([mlp + "down_proj.weight"], None, mlp + "down_proj"), spec.hidden_act)
        norms: dict[str, RMSNorm] = {}
        if self.sandwich:
            norms.update(pre_mlp_norm=take.norm(p + "pre_feedforward_layernorm.weight", eps, 1.0),
                         post_mlp_norm=take.norm(p + "post_feedforward_layernorm.weight", eps, 1.0))
        if self.qk_norm:
            norms.update(q_norm=take.norm(attn + "q_norm.weight", eps, 1.0),
                         k_norm=take.norm(attn + "k_norm.weight", eps, 1.0))
        return GemmaDecoderLayer(spec, qkv, o, gated, take.norm(p + "input_layernorm.weight", eps, 1.0),
                                 take.norm(p + "post_attention_layernorm.weight", eps, 1.0), spec.layer_window(i),
                                 sandwich=self.sandwich, **norms)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = super().embed(input_ids, positions)
        return hidden * torch.tensor(self.spec.hidden_size**0.5, dtype=hidden.dtype)  # HF's normalizer, in dtype


def _sandwich_spec(config: dict, source: str, architecture: str, model_type: str, pattern: int,
                   **family: object) -> ModelSpec:
    """Gemma 2 and 3: local layers (every `pattern`-th global where config.json lists none), the query scale,
    the soft caps."""
    with config_fields(source):
        layer_types = config.get("layer_types") or _layer_types(config, pattern, source)
        scalar = float(config.get("query_pre_attn_scalar", 256))
        caps = {key: None if config.get(name) is None else float(config[name])
                for key, name in (("attn_softcap", "attn_logit_softcapping"),
                                  ("final_softcap", "final_logit_softcapping"))}
    return llama_spec({**config, "model_type": model_type, "layer_types": layer_types,
                       "sliding_window": config.get("sliding_window", 4096)}, source, architecture,
                      hidden_act=_activation(config, source), tie_word_embeddings=True, attention_scale=scalar**-0.5,
                      **caps, **family)


class Gemma2ForCausalLM(GemmaForCausalLM):
    sandwich = True

    @classmethod
    def read_spec(cls, config: dict, source: str) -> ModelSpec:
        return _sandwich_spec(config, source, "Gemma2ForCausalLM", "gemma2", 2)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True

    @classmethod
    def read_spec(cls, config: dict, source: str) -> ModelSpec:
        pattern = int(config.get("sliding_window_pattern", config.get("_sliding_window_pattern", 6)))
        rope = config.get("rope_parameters") or {}
        with config_fields(source):
            if rope and all(isinstance(v, dict) for v in rope.values()):  # keyed by layer type (transformers 5)
                local_theta, local_scaling = rope_parameters(config, "sliding_attention")
                if local_scaling is not None:
                    raise UnsupportedModelError(f"{source}: RoPE scaling on the local layers is not supported")
            else:
                local_theta = float(config.get("rope_local_base_freq", 10000.0))
        return _sandwich_spec(config, source, "Gemma3ForCausalLM", "gemma3_text", pattern, qk_norm=True,
                              local_rope_theta=local_theta)

    def build_rotary(self, max_positions: int, dtype: torch.dtype, device: torch.device) -> nn.Module | None:
        """The global layers' RoPE (model.rotary); the local layers get theirs, at the local base."""
        spec = self.spec
        local = RotaryEmbedding(spec.head_dim, max_positions, spec.local_rope_theta, None, dtype).to(device)
        for i in spec.sliding_layers:
            self.layers[i].local_rotary = local
        return super().build_rotary(max_positions, dtype, device)
