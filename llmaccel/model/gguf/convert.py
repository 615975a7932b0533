"""GGUF -> an HF-format directory in the cache, keyed by the file's hash: for what needs a directory of float
weights (the HF transformers baseline, the distillation teacher) and for GGUF architectures llmaccel does not
read in place (gpt2). llmaccel's own engine reads llama-architecture files in place (gguf/checkpoint.py).

The llama architecture is converted here, each tensor dequantized by gguf/quants.py (bit-equal to the gguf
package), q/k rows un-permuted back to HF's rotate-half layout. GPT-2 is read by transformers' own GGUF loader,
which undoes llama.cpp's changes (the transposed Conv1D projections). The tokenizer and chat template are
rebuilt from the GGUF metadata by transformers either way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from pathlib import Path

import torch

from llmaccel.errors import CorruptCheckpointError, UnsupportedModelError
from llmaccel.model.gguf.names import llama_config
from llmaccel.model.gguf.reader import GGUFFile
from llmaccel.model.gguf.weights import GGUFWeights

logger = logging.getLogger(__name__)

# GGUF general.architecture -> the HF architecture its directory names (llama: converted here, the rest by
# transformers' GGUF loader)
# gguf files of the other families are not read yet: their GGUF metadata lacks fields (Qwen3's head_dim) that
# transformers' GGUF loader does not map, untested here; convert their HF checkpoints instead
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gpt2": "GPT2LMHeadModel"}
SUPPORTED_GGUF_ARCHITECTURES = tuple(GGUF_ARCHITECTURES)


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def gguf_to_hf_dir(path: Path, cache_root: Path) -> Path:
    """Convert once; later calls return the cached directory at once."""
    digest = file_digest(path)
    out = cache_root / "gguf" / f"{path.stem}-{digest[:16]}"
    if (out / "llmaccel-complete").exists():
        return out
    logger.warning("converting %s to an HF directory under %s (once per file)", path.name, out)
    file = GGUFFile(path)
    arch = file.architecture
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedModelError(f"{path}: GGUF architecture {arch!r} is not supported; "
                                    f"llmaccel reads {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    if arch in ("llama", "qwen2"):
        config = llama_config(file)
        weights = GGUFWeights(file, config)
        if "model.embed_tokens.weight" not in weights:
            raise CorruptCheckpointError(f"{path}: GGUF has no token_embd.weight tensor")
        state = {name: weights[name].float().contiguous() for name in weights}
        config["tie_word_embeddings"] = "lm_head.weight" not in state
    else:
        del file
        config, state = _read_with_transformers(path, GGUF_ARCHITECTURES[arch])

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        from safetensors.torch import save_file
        from transformers import AutoTokenizer

        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer.save_pretrained(str(tmp))
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}))
        (tmp / "llmaccel-complete").write_text(str(path) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _read_with_transformers(path: Path, architecture: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, float32 tensors by HF name) through transformers' GGUF loader (every tensor dequantized)."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except Exception as exc:
        raise CorruptCheckpointError(f"{path}: transformers cannot read this GGUF file "
                                     f"({type(exc).__name__}: {exc})") from exc
    config = model.config.to_dict()
    config["architectures"] = [architecture]
    state, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:  # the tied LM head: safetensors stores a tensor once
            continue
        seen.add(tensor.data_ptr())
        state[name] = tensor.detach().contiguous()
    if config.get("tie_word_embeddings", True):
        state.pop("lm_head.weight", None)
    return config, state


