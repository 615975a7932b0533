"""An EAGLE-style draft head as a trainable module, and its directory on disk.

The head drafts from the target's own features rather than from tokens alone (EAGLE, Li et al. 2024):
at position p it reads the embedding of token p and the target's final (normed) hidden state at p - 1,
fused by one linear layer, through one decoder layer of the target's shape, and predicts the target's
hidden state at p, which the target's LM head turns into the next token. A 4-layer student has to
work out the context again from tokens; the head starts from the 30 layers' conclusion, so it keeps
far more of its drafts for about a tenth of the student's cost a token.

The directory holds `config.json` (the target's config with one layer and a `llmaccel_draft_head`
section), `model.safetensors` (`fc.weight`, `model.layers.0.*` and `model.norm.weight` in HF names; no
embedding or LM head: the target's serve), the tokenizer and `token_counts.json`.
spec/draft_head.py runs it in the engine on the paged KV cache; this module trains it in plain torch,
with the engine's numerics (float32 RMS normalisation, rotate-half RoPE).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from llmaccel.model.rope import rope_inverse_frequencies
from llmaccel.model.spec import ModelSpec
from llmaccel.spec.head_dir import HEAD_SECTION

_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_NORMS = ("input_layernorm", "post_attention_layernorm")


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class TrainableHead(nn.Module):
    """fc(cat(embed(x_p), f_{p-1})) -> one decoder layer -> RMSNorm, on dense [batch, tokens] windows."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        if spec.qkv_bias or spec.o_bias or spec.mlp_bias:
            raise ValueError("draft heads are trained for Llama-family models without projection biases; "
                             f"this model ({spec.architecture}) has them")
        hidden = spec.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.eps = spec.rms_norm_eps
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        shapes = {"self_attn.q_proj": (self.num_heads * self.head_dim, hidden),
                  "self_attn.k_proj": (self.num_kv_heads * self.head_dim, hidden),
                  "self_attn.v_proj": (self.num_kv_heads * self.head_dim, hidden),
                  "self_attn.o_proj": (hidden, self.num_heads * self.head_dim),
                  "mlp.gate_proj": (spec.intermediate_size, hidden), "mlp.up_proj": (spec.intermediate_size, hidden),
                  "mlp.down_proj": (hidden, spec.intermediate_size)}
        self.proj = nn.ModuleDict({name.replace(".", "_"): nn.Linear(shape[1], shape[0], bias=False)
                                   for name, shape in shapes.items()})
        self.norms = nn.ParameterDict({name: nn.Parameter(torch.ones(hidden)) for name in (*_NORMS, "norm")})
        self.register_buffer("inv_freq", rope_inverse_frequencies(self.head_dim, spec.rope_theta, spec.rope_scaling,
                                                                  spec.max_position_embeddings), persistent=False)

    def init_from(self, teacher, layer: int) -> None:
        """Start the decoder layer and the final norm from the teacher's (layer `layer` and its norm)."""
        source = teacher.model.layers[layer]
        with torch.no_grad():
            for name in _PROJECTIONS:
                module = source.get_submodule(name)
                self.proj[name.replace(".", "_")].weight.copy_(module.weight)
            for name in _NORMS:
                self.norms[name].copy_(getattr(source, name).weight)
            self.norms["norm"].copy_(teacher.model.norm.weight)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """embeds, features: [B, T, hidden] (token p's embedding, the target's feature at p - 1); returns
        the predicted features at p, [B, T, hidden], normed as the target's are."""
        batch, tokens, _ = embeds.shape
        x = self.fc(torch.cat([embeds, features], dim=-1))
        h = _rms(x, self.norms["input_layernorm"], self.eps)
        p = self.proj
        q = p["self_attn_q_proj"](h).view(batch, tokens, self.num_heads, self.head_dim).transpose(1, 2)
        k = p["self_attn_k_proj"](h).view(batch, tokens, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = p["self_attn_v_proj"](h).view(batch, tokens, self.num_kv_heads, self.head_dim).transpose(1, 2)
        freqs = torch.arange(tokens, device=x.device, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + p["self_attn_o_proj"](attn.transpose(1, 2).reshape(batch, tokens, -1))
        h = _rms(x, self.norms["post_attention_layernorm"], self.eps)
        x = x + p["mlp_down_proj"](F.silu(p["mlp_gate_proj"](h)) * p["mlp_up_proj"](h))
        return _rms(x, self.norms["norm"], self.eps)

    def engine_weights(self) -> dict[str, torch.Tensor]:
        """The weights by the names the directory holds (HF's, for one layer)."""
        weights = {"fc.weight": self.fc.weight}
        for name in _PROJECTIONS:
            weights[f"model.layers.0.{name}.weight"] = self.proj[name.replace(".", "_")].weight
        for name in _NORMS:
            weights[f"model.layers.0.{name}.weight"] = self.norms[name]
        weights["model.norm.weight"] = self.norms["norm"]
        return {k: v.detach().float().contiguous().clone() for k, v in weights.items()}

    def load_engine_weights(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.fc.weight.copy_(weights["fc.weight"])
            for name in _PROJECTIONS:
                self.proj[name.replace(".", "_")].weight.copy_(weights[f"model.layers.0.{name}.weight"])
            for name in _NORMS:
                self.norms[name].copy_(weights[f"model.layers.0.{name}.weight"])
            self.norms["norm"].copy_(weights["model.norm.weight"])


def head_spec(model_dir: Path) -> ModelSpec:
    """The target's spec, from its config.json: the head has its width, heads and RoPE."""
    return ModelSpec.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8")))


def save_head(head: TrainableHead, model_dir: Path, directory: Path, section: dict) -> None:
    """Write the head's config.json (the target's, one layer) and model.safetensors into `directory`."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    config["num_hidden_layers"] = 1
    config["architectures"] = ["LlamaDraftHead"]
    config[HEAD_SECTION] = section
    save_file(head.engine_weights(), str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")

