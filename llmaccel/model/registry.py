"""Architecture name -> the model class that runs it (vLLM's model registry, in small).

config.json names the architecture (`architectures`, or `model_type` where that list is missing; a GGUF
file's `general.architecture` is mapped to it when the file is converted). Each family is one file under
model/ holding a `CausalLM` subclass: its `read_spec` (config.json -> ModelSpec) and its decoder layer.
Adding a family is that file plus its lines here; see docs/models.md, "Adding a model family".
"""

from __future__ import annotations

import importlib

from llmaccel.errors import UnsupportedModelError

# architecture -> (module under llmaccel.model, class)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "GemmaForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
}

# config.json `model_type` -> architecture, for configs that do not list `architectures`
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}


def supported_architectures() -> list[str]:
    return list(ARCHITECTURES)


def resolve_architecture(config: dict, source: str = "config.json") -> str:
    """The supported architecture config.json names, or an error naming what it asks for and what runs."""
    archs = config.get("architectures") or []
    if not isinstance(archs, list):
        archs = [archs]
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None and not archs:
        arch = MODEL_TYPES.get(config.get("model_type"))
    if arch is None:
        found = ", ".join(map(str, archs)) or f"model_type={config.get('model_type')!r}"
        raise UnsupportedModelError(
            f"{source}: architecture {found} is not supported; llmaccel runs {', '.join(ARCHITECTURES)} "
            "(adding one: docs/models.md, 'Adding a model family')")
    return arch


def model_class(architecture: str):
    """The CausalLM subclass that runs `architecture` (imported on first use)."""
    if architecture not in ARCHITECTURES:
        raise UnsupportedModelError(f"architecture {architecture} is not supported; llmaccel runs "
                                    f"{', '.join(ARCHITECTURES)}")
    module, name = ARCHITECTURES[architecture]
    return getattr(importlib.import_module(f"llmaccel.model.{module}"), name)
