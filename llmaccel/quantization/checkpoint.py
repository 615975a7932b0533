"""`llmaccel quantize`: write a quantized checkpoint that `--model DIR` loads directly.

The directory is an HF model directory (config.json, tokenizer files) whose model.safetensors holds
each decoder linear weight as `<name>.qweight` (int8 [N, K], or uint8 [N, K/2] with two INT4 values
per byte), `<name>.scales` and, for INT4, `<name>.zeros`; every other tensor stays as it was.
`llmaccel_quantization.json` records the method and the group sizes.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from llmaccel.quantization.formats import METHODS, Int4Weight, Int8Weight, check_group_size, quantize

CONFIG_NAME = "llmaccel_quantization.json"
LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="model alias, GGUF file or HF directory to quantize")
    parser.add_argument("--method", required=True, help="int8 (per output channel) or int4 (group-wise)")
    parser.add_argument("--group-size", type=int, help="INT4 group size: 32, 64 or 128 (default: the largest that "
                                                       "divides each layer)")
    parser.add_argument("--out", type=Path, required=True, help="directory to write (must not exist or be empty)")


def quantize_checkpoint(model: str, method: str, group_size: int | None, out: Path, progress: bool = True) -> Path:
    from llmaccel.model.loader import hf_dir_for, load_weights

    if method not in METHODS:
        raise ValueError(f"unknown quantization method {method!r}; choose one of {', '.join(METHODS)}")
    if method == "int4" and group_size is not None:
        check_group_size(group_size, group_size)  # the value itself; each layer is checked below
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty; choose a new --out directory")
    hf_dir = hf_dir_for(model)
    weights = load_weights(hf_dir)
    tensors: dict[str, torch.Tensor] = {}
    groups: dict[str, int] = {}
    for name in tqdm(list(weights), desc=f"quantizing to {method}", unit="tensor", disable=not progress):
        tensor = weights[name].float()
        if not LINEAR.fullmatch(name):
            tensors[name] = tensor.contiguous()
            continue
        base = name.removesuffix(".weight")
        weight = quantize(tensor, method, group_size, base)
        if isinstance(weight, Int8Weight):
            tensors[base + ".qweight"], tensors[base + ".scales"] = weight.q, weight.scale
        else:
            tensors[base + ".qweight"], tensors[base + ".scales"] = weight.packed, weight.scale
            tensors[base + ".zeros"] = weight.zero
            groups[base] = weight.group_size
    out.mkdir(parents=True, exist_ok=True)
    for item in hf_dir.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and not item.name.endswith(".index.json"):
            shutil.copy2(item, out / item.name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / CONFIG_NAME).write_text(json.dumps({"method": method, "group_sizes": groups, "source": model}, indent=1))
    return out


def load_prequantized(hf_dir: Path, weights: Mapping[str, torch.Tensor]) -> tuple[str, dict] | None:
    """(method, {weight name: Int8Weight | Int4Weight}) for a directory written by quantize_checkpoint."""
    path = hf_dir / CONFIG_NAME
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    method = config.get("method")
    if method not in METHODS:
        raise ValueError(f"{path}: unknown method {method!r}")
    out: dict[str, Int8Weight | Int4Weight] = {}
    for name in weights:
        if not name.endswith(".qweight"):
            continue
        base = name.removesuffix(".qweight")
        if method == "int8":
            out[base + ".weight"] = Int8Weight(weights[name], weights[base + ".scales"].float())
        else:
            out[base + ".weight"] = Int4Weight(weights[name], weights[base + ".scales"].float(),
                                               weights[base + ".zeros"].float(), int(config["group_sizes"][base]))
    return method, out


def run(args: argparse.Namespace) -> int:
    out = quantize_checkpoint(args.model, args.method, args.group_size, args.out)
    print(f"wrote {out}: load it with --model {out}", file=sys.stderr)
    return 0
