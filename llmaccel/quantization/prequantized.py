"""Reading a checkpoint that `llmaccel quantize` wrote (quantization/checkpoint.py writes it): what the
engine needs at load time, kept apart from the writer, which runs the engine itself (a float model's
perplexity, AWQ's activations), so the engine never imports the tool above it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from llmaccel.quantization.formats import METHODS, Int4Weight, Int8Weight

CONFIG_NAME = "llmaccel_quantization.json"


def read_quantization_config(hf_dir: Path) -> dict | None:
    path = hf_dir / CONFIG_NAME
    return json.loads(path.read_text()) if path.is_file() else None


def load_prequantized(hf_dir: Path, weights: Mapping[str, torch.Tensor]) -> tuple[str, dict] | None:
    """(method, {weight name: Int8Weight | Int4Weight}) for a directory written by quantize_checkpoint.
    A tensor with zeros is INT4; one without is INT8 (the embedding is INT8 even in an INT4 checkpoint)."""
    config = read_quantization_config(hf_dir)
    if config is None:
        return None
    method = config.get("method")
    if method not in METHODS:
        raise ValueError(f"{hf_dir / CONFIG_NAME}: unknown method {method!r}")
    out: dict[str, Int8Weight | Int4Weight] = {}
    names = set(weights)
    for name in names:
        if not name.endswith(".qweight"):
            continue
        base = name.removesuffix(".qweight")
        if base + ".zeros" not in names:
            q, scale = weights[name], weights[base + ".scales"].float()
            group = None if scale.dim() == 1 else q.shape[1] // scale.shape[1]
            out[base + ".weight"] = Int8Weight(q, scale, group)
        else:
            out[base + ".weight"] = Int4Weight(weights[name], weights[base + ".scales"].float(),
                                               weights[base + ".zeros"].float(), int(config["group_sizes"][base]))
    return method, out
