"""A llama- or qwen2-architecture GGUF file as a checkpoint, read in place: no converted copy of its weights.

The weights stay in the mapped file (model/gguf/weights.py). What the rest of llmaccel reads from a directory,
config.json, the tokenizer and generation_config.json, is written once into a small directory in the cache,
keyed by a hash of the file's metadata and size (hashing the metadata costs milliseconds where hashing a 5 GB
file cost seconds); the tokenizer and chat template are rebuilt from the GGUF metadata by transformers.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

from llmaccel.errors import CorruptCheckpointError
from llmaccel.model.gguf.names import llama_config
from llmaccel.model.gguf.reader import GGUFFile
from llmaccel.model.gguf.weights import GGUFWeights

logger = logging.getLogger(__name__)
NATIVE_ARCHITECTURES = ("llama", "qwen2")  # read in place; others go through gguf/convert.py


def files_dir(file: GGUFFile, config: dict, cache_root: Path) -> Path:
    """The cache directory holding this file's config.json, tokenizer files and generation_config.json."""
    out = cache_root / "gguf-files" / f"{file.path.stem}-{file.header_digest()[:16]}"
    if (out / "llmaccel-complete").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(file.path.parent), gguf_file=file.path.name)
        except Exception as exc:
            raise CorruptCheckpointError(f"{file.path}: cannot rebuild the tokenizer from the GGUF metadata "
                                         f"({type(exc).__name__}: {exc})") from exc
        tokenizer.save_pretrained(str(tmp))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}))
        (tmp / "llmaccel-complete").write_text(str(file.path) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def gguf_model(path: Path, cache_root: Path) -> tuple[Path, dict, GGUFWeights]:
    """(the directory of config and tokenizer files, config.json's contents, the weights) of a GGUF file read in
    place."""
    file = GGUFFile(path)
    config = llama_config(file)
    weights = GGUFWeights(file, config)
    if "model.embed_tokens.weight" not in weights:
        raise CorruptCheckpointError(f"{path}: the GGUF file has no token_embd.weight tensor")
    config["tie_word_embeddings"] = "lm_head.weight" not in weights
    return files_dir(file, config, cache_root), config, weights
