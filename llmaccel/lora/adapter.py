"""A PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`) read and checked against
the served model: each targeted projection's A and B, the scaling folded into B.

PEFT names a layer's projections as HF does (q_proj ... down_proj); llmaccel fuses q, k and v into one `qkv`
projection and gate and up into `gate_up`, so each PEFT target is a part of one of llmaccel's projections: its
rows of the fused output, and its own columns in the adapter's share of the batched LoRA matrices (lora/layers.py).
Anything the batched path cannot compute exactly (DoRA, trained biases, modules saved whole, the embedding or the
LM head) is a named error, never silently dropped.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from llmaccel.errors import LLMAccelError
from llmaccel.model.spec import ModelSpec


class AdapterError(LLMAccelError):
    """A LoRA adapter that cannot be served on this model (named: the path, the field or tensor, and why)."""


# PEFT target -> (llmaccel's projection, the part's index: its column block in the adapter's share)
TARGETS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "qkv_proj": ("qkv", 0),
           "o_proj": ("o", 0), "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "gate_up_proj": ("gate_up", 0),
           "down_proj": ("down", 0)}
PARTS = {"qkv": 3, "o": 1, "gate_up": 2, "down": 1}  # column blocks of max_lora_rank in each projection's share
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


@dataclass(frozen=True)
class LoRAPiece:
    """One PEFT target of one layer: delta(x) = B (A x), for the output rows [row_start, row_start + B rows)
    of llmaccel's projection `module`, in column block `part` of the adapter's share."""

    layer: int
    module: str
    part: int
    row_start: int
    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out rows, rank], already times the adapter's scaling


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: str
    rank: int  # the largest rank of any target
    pieces: tuple[LoRAPiece, ...]
    digest: str  # of the weights and config: the prefix cache keys the adapter's KV by it


def part_rows(spec: ModelSpec) -> dict[str, tuple[int, int, int]]:
    """PEFT target -> (its first output row in llmaccel's fused projection, its rows, its input width)."""
    q, kv, inter, hidden = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, \
        spec.intermediate_size, spec.hidden_size
    return {"q_proj": (0, q, hidden), "k_proj": (q, kv, hidden), "v_proj": (q + kv, kv, hidden),
            "qkv_proj": (0, q + 2 * kv, hidden), "o_proj": (0, hidden, q), "gate_proj": (0, inter, hidden),
            "up_proj": (inter, inter, hidden), "gate_up_proj": (0, 2 * inter, hidden), "down_proj": (0, hidden, inter)}


def read_adapter(name: str, path: str | Path, spec: ModelSpec, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """The adapter at `path`, checked against `spec` and `max_rank`; AdapterError names what does not fit."""
    root = Path(path).expanduser()
    where = f"LoRA adapter {name!r} ({root})"
    config_path, weights_path = root / "adapter_config.json", root / "adapter_model.safetensors"
    if not root.is_dir():
        raise AdapterError(f"{where}: no such directory")
    if not config_path.is_file():
        raise AdapterError(f"{where}: adapter_config.json is missing (a PEFT adapter directory holds "
                           "adapter_config.json and adapter_model.safetensors)")
    if not weights_path.is_file():
        other = " (adapter_model.bin is a pickle: save it with safe_serialization=True)" \
            if (root / "adapter_model.bin").is_file() else ""
        raise AdapterError(f"{where}: adapter_model.safetensors is missing{other}")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{where}: adapter_config.json is not JSON ({exc})") from None
    scalings = _check_config(config, where, max_rank)
    sizes = part_rows(spec)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_path), "pt") as file:
            for key in file.keys():
                match = _KEY.search(key)
                if match is None:
                    raise AdapterError(f"{where}: tensor {key!r} is not a LoRA A or B of a decoder projection "
                                       f"(llmaccel serves LoRA on {', '.join(TARGETS)})")
                layer, target, which = int(match[1]), match[2], match[3]
                if target not in TARGETS:
                    raise AdapterError(f"{where}: tensor {key!r} targets {target!r}; llmaccel serves LoRA on "
                                       f"{', '.join(TARGETS)}")
                if layer >= spec.num_layers:
                    raise AdapterError(f"{where}: tensor {key!r} is for layer {layer}, but the model has "
                                       f"{spec.num_layers} layers: the adapter was trained for another base model")
                found.setdefault((layer, target), {})[which] = file.get_tensor(key)
    except AdapterError:
        raise
    except Exception as exc:  # a truncated or foreign file
        raise AdapterError(f"{where}: adapter_model.safetensors cannot be read ({exc})") from None
    if not found:
        raise AdapterError(f"{where}: adapter_model.safetensors holds no LoRA tensors")
    pieces, rank = [], 0
    for (layer, target), pair in sorted(found.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{where}: layer {layer}'s {target} has lora_{'A' if 'A' not in pair else 'B'} "
                               "missing")
        a, b = pair["A"], pair["B"]
        row_start, rows, width = sizes[target]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != width or b.shape != (rows, r):
            raise AdapterError(f"{where}: layer {layer}'s {target} is A {tuple(a.shape)}, B {tuple(b.shape)}; this "
                               f"model needs A (rank, {width}) and B ({rows}, rank): the adapter was trained for "
                               "another base model")
        if r > max_rank:
            raise AdapterError(f"{where}: rank {r} (layer {layer}'s {target}) is over --max-lora-rank {max_rank}")
        rank = max(rank, r)
        module, part = TARGETS[target]
        block = "mlp" if module in ("gate_up", "down") else "self_attn"
        scaling = scalings(f"model.layers.{layer}.{block}.{target}", r)
        pieces.append(LoRAPiece(layer, module, part, row_start, a.to(dtype).contiguous(),
                                (b.double() * scaling).to(dtype).contiguous()))
    _check_overlaps(pieces, where)
    digest = hashlib.sha256(config_path.read_bytes() + weights_path.read_bytes()).hexdigest()[:16]
    return LoRAAdapter(name, str(root), rank, tuple(pieces), digest)


def _check_config(config: dict, where: str, max_rank: int):
    """The scaling of each target (PEFT: lora_alpha / r, or / sqrt(r) with rsLoRA; per-target patterns)."""
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: peft_type is {config.get('peft_type')!r}; llmaccel serves LORA adapters")
    unsupported = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out (GPT-2 Conv1D layers)"}
    for field, what in unsupported.items():
        if config.get(field):
            raise AdapterError(f"{where}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{where}: bias={config['bias']!r}: trained biases are not supported (bias='none')")
    if config.get("modules_to_save"):
        raise AdapterError(f"{where}: modules_to_save {config['modules_to_save']} replaces whole modules; llmaccel "
                           "serves LoRA deltas only")
    r = config.get("r", 8)
    if not isinstance(r, int) or r < 1:
        raise AdapterError(f"{where}: r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise AdapterError(f"{where}: rank {r} is over --max-lora-rank {max_rank}")
    alpha, alpha_pattern = config.get("lora_alpha", 8), config.get("alpha_pattern") or {}
    rs = bool(config.get("use_rslora"))

    def scaling(module_name: str, rank: int) -> float:
        """As PEFT matches a pattern key: the module's name ends with it (the ranks are the tensors' own)."""
        a = next((v for k, v in alpha_pattern.items() if re.fullmatch(rf"(.*\.)?(?:{k})", module_name)), alpha)
        return a / math.sqrt(rank) if rs else a / rank

    return scaling


def _check_overlaps(pieces: list[LoRAPiece], where: str) -> None:
    seen = set()
    for p in pieces:
        if (p.layer, p.module, p.part) in seen:
            raise AdapterError(f"{where}: layer {p.layer}'s {p.module} is targeted twice (fused and per part)")
        seen.add((p.layer, p.module, p.part))
