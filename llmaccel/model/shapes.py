"""Published model shapes, for checkpoints of random weights that measure speed and memory at real sizes.

Speed and memory depend on a model's shapes, not its values, and the only real checkpoint on these machines is
the 135M default model; so `llmaccel bench make-model` writes a checkpoint of random weights at one of these
shapes (with the default model's tokenizer and chat template: vocabulary 49,152, where the published models
have 128k-152k tokens; say so beside every figure). Quality is never measured on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelShape:
    name: str
    architecture: str  # the HF architecture (LlamaForCausalLM, Qwen2ForCausalLM)
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    rope_theta: float
    source: str  # which published checkpoint's config.json this follows
    max_position_embeddings: int = 131072
    qkv_bias: bool = False
    rope_scaling: dict | None = field(default=None, hash=False)
    vocab_size: int = 49152  # the default model's tokenizer

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: {self.num_heads} heads do not group over {self.num_kv_heads} KV heads")

    @property
    def num_parameters(self) -> int:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        layer = self.hidden_size * (q + 2 * kv) + q * self.hidden_size + 3 * self.hidden_size * self.intermediate_size
        tables = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + tables

    def hf_config(self) -> dict:
        """config.json of the shape, as transformers writes one."""
        model_type = "qwen2" if self.architecture == "Qwen2ForCausalLM" else "llama"
        config = {
            "architectures": [self.architecture], "model_type": model_type, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings, "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings, "torch_dtype": "bfloat16",
            "attention_bias": self.qkv_bias if model_type == "llama" else False, "mlp_bias": False,
        }
        if self.rope_scaling:
            config["rope_scaling"] = dict(self.rope_scaling)
        return config


_LLAMA3_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}

SHAPES = {shape.name: shape for shape in (
    ModelShape("llama-1b", "LlamaForCausalLM", 2048, 8192, 16, 32, 8, 64, True, 500000.0, "meta-llama/Llama-3.2-1B",
               rope_scaling=_LLAMA3_SCALING),
    ModelShape("llama-3b", "LlamaForCausalLM", 3072, 8192, 28, 24, 8, 128, True, 500000.0, "meta-llama/Llama-3.2-3B",
               rope_scaling=_LLAMA3_SCALING),
    ModelShape("llama-8b", "LlamaForCausalLM", 4096, 14336, 32, 32, 8, 128, False, 500000.0,
               "meta-llama/Llama-3.1-8B", rope_scaling={**_LLAMA3_SCALING, "factor": 8.0}),
    ModelShape("qwen-0.5b", "Qwen2ForCausalLM", 896, 4864, 24, 14, 2, 64, True, 1000000.0, "Qwen/Qwen2.5-0.5B",
               max_position_embeddings=32768, qkv_bias=True),
    ModelShape("qwen-7b", "Qwen2ForCausalLM", 3584, 18944, 28, 28, 4, 128, False, 1000000.0, "Qwen/Qwen2.5-7B",
               max_position_embeddings=32768, qkv_bias=True),
)}


def shape_named(name: str) -> ModelShape:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; choose one of {', '.join(SHAPES)}")
    return SHAPES[name]
