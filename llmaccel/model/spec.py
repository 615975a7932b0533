"""ModelSpec: the architecture numbers the engine needs, read from an HF config.json."""

from __future__ import annotations

from dataclasses import dataclass

from llmaccel.errors import CorruptCheckpointError, UnsupportedModelError

# architecture name (config.json "architectures") -> model_type; all run on model/llama.py
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf_config(cls, config: dict, source: str = "config.json") -> ModelSpec:
        archs = config.get("architectures") or []
        model_type = config.get("model_type")
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            arch = next((a for a, t in SUPPORTED_ARCHITECTURES.items() if t == model_type and not archs), None)
        if arch is None:
            found = ", ".join(archs) or f"model_type={model_type!r}"
            raise UnsupportedModelError(
                f"{source}: architecture {found} is not supported; llmaccel runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        try:
            num_heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
            theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"} or None
            if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
                scaling = None
            eos = config.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
            is_qwen2 = SUPPORTED_ARCHITECTURES[arch] == "qwen2"
            return cls(
                architecture=arch,
                model_type=SUPPORTED_ARCHITECTURES[arch],
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_layers=int(config["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
                head_dim=int(config.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                rope_scaling=scaling,
                max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                qkv_bias=is_qwen2 or bool(config.get("attention_bias", False)),
                o_bias=not is_qwen2 and bool(config.get("attention_bias", False)),
                mlp_bias=bool(config.get("mlp_bias", False)),
                sliding_window=int(window) if window else None,
                eos_token_ids=eos_ids,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptCheckpointError(f"{source}: missing or invalid field ({exc})") from exc

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token across all layers, at 4 bytes per element (scaled by dtype)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim
