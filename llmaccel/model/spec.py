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
    sliding_window: int | None  # the window of the layers that slide (Mistral: all; Qwen2: the upper ones)
    sliding_layers: tuple[int, ...]
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
            is_qwen2 = SUPPORTED_ARCHITECTURES[arch] == "qwen2"
            window, sliding_layers = _sliding_window(config, int(config["num_hidden_layers"]), is_qwen2)
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
                sliding_window=window,
                sliding_layers=sliding_layers,
                eos_token_ids=eos_ids,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptCheckpointError(f"{source}: missing or invalid field ({exc})") from exc

    def layer_window(self, layer: int) -> int | None:
        """The sliding window layer `layer` attends within, or None for full attention."""
        return self.sliding_window if layer in self.sliding_layers else None

    @property
    def kv_window(self) -> int | None:
        """The window when every layer slides: then no layer ever reads a key older than it, and the
        KV cache may free those blocks. A model mixing in full-attention layers must keep them all."""
        return self.sliding_window if len(self.sliding_layers) == self.num_layers else None

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token across all layers, at 4 bytes per element (scaled by dtype)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def _sliding_window(config: dict, num_layers: int, is_qwen2: bool) -> tuple[int | None, tuple[int, ...]]:
    """The declared sliding window and the layers it applies to, as transformers reads them: the
    config's `layer_types` where given; otherwise Qwen2 slides from layer `max_window_layers` on (and
    only with `use_sliding_window`), Mistral in every layer."""
    window = config.get("sliding_window")
    if not window or (is_qwen2 and not config.get("use_sliding_window", False)):
        return None, ()
    layer_types = config.get("layer_types")
    if layer_types:
        layers = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    elif is_qwen2:
        layers = tuple(range(int(config.get("max_window_layers", 28)), num_layers))
    else:
        layers = tuple(range(num_layers))
    return (int(window), layers) if layers else (None, ())
