"""ModelSpec: the architecture numbers the engine needs, read from an HF config.json.

Which family reads a config is the registry's choice (model/registry.py); `llama_spec` reads the
fields the Llama family and the families built on it share, each family adding its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from llmaccel.errors import CorruptCheckpointError, LLMAccelError


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
    rms_norm_eps: float  # the eps of every norm (GPT-2's LayerNorms too)
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
    # what the families beyond Llama add (model/qwen3.py, gemma.py, phi3.py, gpt2.py)
    hidden_act: str = "silu"  # the MLP's activation: silu (SwiGLU), gelu_tanh (GeGLU; GPT-2's MLP)
    qk_norm: bool = False  # an RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    attention_scale: float | None = None  # the softmax scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # cap * tanh(scores / cap) before the softmax (Gemma 2)
    final_softcap: float | None = None  # the same on the logits (Gemma 2)
    local_rope_theta: float | None = None  # the RoPE base of the sliding layers, where it differs (Gemma 3)

    @classmethod
    def from_hf_config(cls, config: dict, source: str = "config.json") -> ModelSpec:
        """The spec of the family config.json names (model/registry.py); an error names an unsupported one."""
        from llmaccel.model.registry import model_class, resolve_architecture

        return model_class(resolve_architecture(config, source)).read_spec(config, source)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window layer `layer` attends within, or None for full attention."""
        return self.sliding_window if layer in self.sliding_layers else None

    @property
    def kv_window(self) -> int | None:
        """The window when every layer slides: then no layer ever reads a key older than it, and the
        KV cache may free those blocks. A model mixing in full-attention layers must keep them all."""
        return self.sliding_window if len(self.sliding_layers) == self.num_layers else None


def llama_spec(config: dict, source: str, architecture: str, **family: object) -> ModelSpec:
    """The spec of a Llama-shaped config (Llama, Mistral, Qwen2/3, Phi-3, Gemma), `family` overriding or adding
    fields. A missing or malformed field is an error naming it."""
    with config_fields(source):
        num_heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        theta, scaling = rope_parameters(config)
        model_type = str(config.get("model_type") or architecture)
        is_qwen2 = model_type in ("qwen2", "qwen3")
        window, sliding_layers = sliding_window(config, int(config["num_hidden_layers"]), is_qwen2)
        fields = dict(
            architecture=architecture,
            model_type=model_type,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
            o_bias=model_type != "qwen2" and bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            sliding_window=window,
            sliding_layers=sliding_layers,
            eos_token_ids=eos_ids(config.get("eos_token_id")),
        )
        return ModelSpec(**{**fields, **family})


@contextmanager
def config_fields(source: str) -> Iterator[None]:
    """Reading config.json inside it, a missing or malformed field becomes an error naming the file and field."""
    try:
        yield
    except LLMAccelError:
        raise
    except KeyError as exc:
        raise CorruptCheckpointError(f"{source}: missing field {exc.args[0]!r}, which this model family "
                                     "needs") from exc
    except (TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{source}: invalid field ({exc})") from exc


def eos_ids(eos: object) -> tuple[int, ...]:
    return tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())


def rope_parameters(config: dict, layer_type: str | None = None) -> tuple[float, dict | None]:
    """(theta, scaling or None) from `rope_parameters` (transformers 5, per layer type where it is keyed so)
    or the older `rope_theta` + `rope_scaling`."""
    if config.get("llmaccel_rope_freq_factors"):  # a GGUF file's rope_freqs (model/gguf/names.py)
        return float(config.get("rope_theta", 10000.0)), {"rope_type": "freq_factors",
                                                           "factors": config["llmaccel_rope_freq_factors"]}
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope and all(isinstance(v, dict) for v in rope.values()):  # keyed by layer type (Gemma 3)
        rope = rope.get(layer_type or "full_attention", {})
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    else:
        theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"} or None
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return float(theta), scaling


def sliding_window(config: dict, num_layers: int, is_qwen2: bool) -> tuple[int | None, tuple[int, ...]]:
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
