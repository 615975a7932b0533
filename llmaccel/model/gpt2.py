"""GPT-2: learned absolute positions, LayerNorm with bias, multi-head attention from one fused `c_attn`, a
GELU (tanh) MLP, the LM head tied to the token embedding.

HF's GPT-2 stores its projections as Conv1D, weight [in, out]: the loader transposes them to the [out, in]
of every other family, so the kernels, quantization and kernel choice are the same. Checkpoints name tensors
with or without the `transformer.` prefix (HF's own saves, the original OpenAI conversion); both load.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from llmaccel.errors import UnsupportedModelError
from llmaccel.model.causal_lm import CausalLM, WeightLoader
from llmaccel.model.layers import Embedding
from llmaccel.model.spec import ModelSpec, config_fields, eos_ids
from llmaccel.ops.attention import AttentionMetadata, PagedAttention

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """OpenAI GPT's GELU, written as HF's NewGELUActivation writes it (so float32 rounds as HF does)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


ACTIVATIONS = {"gelu_new": gelu_new, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
               "gelu": F.gelu, "relu": F.relu}


class LayerNorm(nn.Module):
    """LayerNorm with bias; `add_forward` folds the residual add in, as RMSNorm's does."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x + residual
        return self(residual), residual


class GPT2Loader(WeightLoader):
    def prepare(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.t() if name.endswith(_CONV1D) else tensor


class GPT2Block(nn.Module):
    def __init__(self, spec: ModelSpec, prefix: str, take: WeightLoader) -> None:
        super().__init__()
        p, eps = prefix, spec.rms_norm_eps
        self.num_heads, self.head_dim = spec.num_heads, spec.head_dim
        self.ln_1 = LayerNorm(take(p + "ln_1.weight"), take(p + "ln_1.bias"), eps)
        self.ln_2 = LayerNorm(take(p + "ln_2.weight"), take(p + "ln_2.bias"), eps)
        self.qkv = take.linear([p + "attn.c_attn.weight"], take(p + "attn.c_attn.bias"), p + "attn.c_attn")
        self.o = take.linear([p + "attn.c_proj.weight"], take(p + "attn.c_proj.bias"), p + "attn.c_proj")
        self.fc = take.linear([p + "mlp.c_fc.weight"], take(p + "mlp.c_fc.bias"), p + "mlp.c_fc")
        self.proj = take.linear([p + "mlp.c_proj.weight"], take(p + "mlp.c_proj.bias"), p + "mlp.c_proj")
        self.act = ACTIVATIONS[spec.hidden_act]

    @property
    def projections(self) -> tuple[nn.Module, ...]:
        return self.qkv, self.o, self.fc, self.proj

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rotary: None, attention: PagedAttention, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.ln_1(hidden)
        else:
            hidden, residual = self.ln_1.add_forward(hidden, residual)
        tokens, width = hidden.shape[0], self.num_heads * self.head_dim
        qkv = self.qkv(hidden)
        q, k, v = (qkv[:, i * width:(i + 1) * width].view(tokens, self.num_heads, self.head_dim) for i in range(3))
        attn = attention.forward(q, k, v, kv_cache[0], kv_cache[1], meta).reshape(tokens, width)
        hidden, residual = self.ln_2.add_forward(self.o(attn), residual)
        return self.proj(self.act(self.fc(hidden))), residual


class GPT2LMHeadModel(CausalLM):
    loader_class = GPT2Loader

    @classmethod
    def read_spec(cls, config: dict, source: str) -> ModelSpec:
        act = config.get("activation_function", "gelu_new")
        if act not in ACTIVATIONS:
            raise UnsupportedModelError(f"{source}: activation_function {act!r} is not supported; GPT-2 runs "
                                        f"{', '.join(ACTIVATIONS)}")
        if config.get("scale_attn_by_inverse_layer_idx") or config.get("add_cross_attention"):
            raise UnsupportedModelError(f"{source}: scale_attn_by_inverse_layer_idx and cross-attention are not "
                                        "supported")
        with config_fields(source):
            hidden, heads = int(config["n_embd"]), int(config["n_head"])
            if hidden % heads:
                raise ValueError(f"n_embd {hidden} is not a multiple of n_head {heads}")
            return ModelSpec(
                architecture="GPT2LMHeadModel", model_type="gpt2", vocab_size=int(config["vocab_size"]),
                hidden_size=hidden, intermediate_size=int(config.get("n_inner") or 4 * hidden),
                num_layers=int(config["n_layer"]), num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
                rms_norm_eps=float(config.get("layer_norm_epsilon", 1e-5)), rope_theta=0.0, rope_scaling=None,
                max_position_embeddings=int(config["n_positions"]),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", True)), qkv_bias=True, o_bias=True,
                mlp_bias=True, sliding_window=None, sliding_layers=(),
                eos_token_ids=eos_ids(config.get("eos_token_id")), hidden_act=act,
                attention_scale=None if config.get("scale_attn_weights", True) else 1.0)

    def weight_names(self, take: WeightLoader) -> tuple[str, str, str]:
        self.prefix = "transformer." if "transformer.wte.weight" in take else ""
        return self.prefix + "wte.weight", "lm_head.weight", self.prefix + "ln_f.weight"

    def build_embedding(self, take: WeightLoader, quantize_embedding: bool) -> None:
        super().build_embedding(take, quantize_embedding)
        self.positions = Embedding(take(self.prefix + "wpe.weight"))

    def build_layer(self, i: int, take: WeightLoader) -> nn.Module:
        return GPT2Block(self.spec, f"{self.prefix}h.{i}.", take)

    def build_final_norm(self, take: WeightLoader) -> nn.Module:
        return LayerNorm(take(self.prefix + "ln_f.weight"), take(self.prefix + "ln_f.bias"), self.spec.rms_norm_eps)

    def build_rotary(self, max_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        return None  # positions are learned, added to the embedding

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids, positions) + self.positions.rows(positions)
