"""`llmaccel quantize`: write a quantized checkpoint that `--model DIR` loads directly.

The directory is an HF model directory (config.json, tokenizer files) whose model.safetensors holds
each decoder linear weight as `<name>.qweight` (int8 [N, K], or uint8 [N, K/2] with two INT4 values
per byte), `<name>.scales` and, for INT4, `<name>.zeros`; every other tensor stays as it was.
`llmaccel_quantization.json` records the method, the group sizes, the AWQ settings and the float
model's perplexity on the quality-watch validation slice (the reference `serve
--quality-check-interval` compares against).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from llmaccel.quantization.formats import METHODS, Int8Weight, check_group_size, quantize, quantize_int8
from llmaccel.quantization.prequantized import CONFIG_NAME

# the decoder projections of every family stored in [out, in] (Llama, Qwen3, Gemma; Phi-3's fused ones)
LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.([qkvo]|qkv)_proj|mlp\.(gate|up|down|gate_up)_proj)\.weight")
# AWQ folds each scale into the norm or projection before it, which it knows for these layouts only
AWQ_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
EMBEDDING_TABLES = ("model.embed_tokens.weight", "lm_head.weight")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="model alias, GGUF file or HF directory to quantize")
    parser.add_argument("--method", required=True, help="int8 (per output channel) or int4 (group-wise)")
    parser.add_argument("--group-size", type=int, help="INT4 group size: 32 (default, GGUF's grid), 64 or 128; it must "
                                                       "divide each layer's inputs")
    parser.add_argument("--awq", action="store_true",
                        help="activation-aware per-input-channel scales, searched on calibration data before "
                             "rounding (default calibration: the built-in chat prompts)")
    parser.add_argument("--calib", type=Path,
                        help='AWQ calibration JSONL: one {"text": ...}, {"prompt": ...} or {"messages": [...]} '
                             "per line")
    parser.add_argument("--calib-samples", type=int, default=128,
                        help="use the first this many calibration samples (each cut to 512 tokens)")
    parser.add_argument("--quantize-embedding", action="store_true",
                        help="store the embedding and LM head in INT8 per row too (one copy when tied)")
    parser.add_argument("--out", type=Path, required=True, help="directory to write (must not exist or be empty)")


@dataclass(frozen=True)
class AWQOptions:
    calib: Path | None = None  # None: the built-in chat prompts
    samples: int = 128


def quantize_checkpoint(model: str, method: str, group_size: int | None, out: Path, awq: AWQOptions | None = None,
                        quantize_embedding: bool = False, progress: bool = True) -> Path:
    from llmaccel.llm import LLM
    from llmaccel.model.loader import hf_dir_for, load_weights, read_spec
    from llmaccel.quantization.quality import validation_perplexity

    if method not in METHODS:
        raise ValueError(f"unknown quantization method {method!r}; choose one of {', '.join(METHODS)}")
    if method == "int4" and group_size is not None:
        check_group_size(group_size, group_size)  # the value itself; each layer is checked below
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty; choose a new --out directory")
    hf_dir = hf_dir_for(model)
    architecture = read_spec(hf_dir).architecture
    if architecture == "GPT2LMHeadModel":
        raise ValueError(f"{model} is GPT-2, whose checkpoints llmaccel does not save quantized; quantize it at load "
                         "with --quantization int8 or int4")
    if awq is not None and architecture not in AWQ_ARCHITECTURES:
        raise ValueError(f"AWQ runs on {', '.join(AWQ_ARCHITECTURES)}, not {architecture}: drop --awq (plain "
                         f"{method} works for every family)")
    float_model = LLM(model)  # the reference perplexity, and AWQ's calibration activations
    reference = validation_perplexity(float_model.engine)
    weights = {name: tensor.float() for name, tensor in load_weights(hf_dir).items()}
    alphas = None
    if awq is not None:
        from llmaccel.quantization.awq import apply_awq, record_activations
        from llmaccel.quantization.calibration import calibration_token_ids

        samples = calibration_token_ids(float_model.tokenizer, awq.calib, awq.samples)
        recorders = record_activations(float_model, samples, progress)
        spec = float_model.engine.spec
        alphas = apply_awq(weights, recorders, spec.num_layers, spec.num_heads, spec.num_kv_heads, method,
                           group_size)
    del float_model
    tensors: dict[str, torch.Tensor] = {}
    groups: dict[str, int] = {}
    for name in tqdm(list(weights), desc=f"quantizing to {method}", unit="tensor", disable=not progress):
        tensor = weights[name]
        base = name.removesuffix(".weight")
        if LINEAR.fullmatch(name):
            weight = quantize(tensor, method, group_size, base)
        elif quantize_embedding and name in EMBEDDING_TABLES:
            weight = quantize_int8(tensor)
        else:
            tensors[name] = tensor.contiguous()
            continue
        if isinstance(weight, Int8Weight):
            tensors[base + ".qweight"], tensors[base + ".scales"] = weight.q, weight.scale
        else:
            tensors[base + ".qweight"], tensors[base + ".scales"] = weight.packed, weight.scale
            tensors[base + ".zeros"] = weight.zero
            groups[base] = weight.group_size
    out.mkdir(parents=True, exist_ok=True)
    for item in hf_dir.iterdir():
        if (item.is_file() and item.suffix != ".safetensors" and not item.name.endswith(".index.json")
                and not item.name.startswith("llmaccel-")):  # the GGUF conversion cache's own marker
            shutil.copy2(item, out / item.name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {"method": method, "group_sizes": groups, "embedding": "int8" if quantize_embedding else None,
              "awq": None if awq is None else {"calib": str(awq.calib or "builtin"), "samples": awq.samples,
                                               "alphas": alphas},
              "reference_perplexity": reference, "source": model}
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=1))
    return out


def run(args: argparse.Namespace) -> int:
    if (args.calib is not None or args.calib_samples != 128) and not args.awq:
        raise ValueError("--calib and --calib-samples choose AWQ's calibration data; add --awq")
    awq = AWQOptions(args.calib, args.calib_samples) if args.awq else None
    out = quantize_checkpoint(args.model, args.method, args.group_size, args.out, awq, args.quantize_embedding)
    print(f"wrote {out}: load it with --model {out}", file=sys.stderr)
    return 0
