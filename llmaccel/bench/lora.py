"""`llmaccel bench lora`: what serving many LoRA adapters in one batch costs (issue 46).

One engine with --max-loras adapters loaded, in alternating rounds: the batch with no adapter (the base model alone:
those steps run exactly the path of an engine without LoRA), then the same prompts spread over N adapters
round-robin (every step mixes them), then all on one adapter. Random adapters at --rank on every projection PEFT
targets in Llama (q, k, v, o, gate, up, down), written as PEFT directories: speed does not depend on their values.
Reported: output tok/s per arm (medians) and each adapter arm over the base: the ratio of the medians, and the
median of each round's ratio (an arm against the base run just before it, so a drift of the VM between rounds
does not enter it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from llmaccel.data.prompts import builtin_prompts
from llmaccel.llm import LLM
from llmaccel.lora.adapter import part_rows
from llmaccel.model.spec import ModelSpec
from llmaccel.platform import machine_record
from llmaccel.sampling_params import SamplingParams

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="the base model (alias, GGUF file or HF directory)")
    parser.add_argument("--adapters", type=int, default=8, help="different adapters the batch spreads over")
    parser.add_argument("--rank", type=int, default=16, help="each adapter's rank (--max-lora-rank too)")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests in the batch")
    parser.add_argument("--output-len", type=int, default=128, help="tokens each generates (EOS ignored)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of every arm")
    parser.add_argument("--dtype", default="auto", help="the engine's dtype")
    parser.add_argument("--quantization", choices=("int8", "int4", "gguf"), help="the base model's weights")
    parser.add_argument("--result-json", type=Path, help="write every figure to this JSON file")


def write_adapter(out: Path, spec: ModelSpec, rank: int, seed: int) -> str:
    """A PEFT adapter directory of random A and B (B scaled small, as a trained one is) on every Llama target."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for target in TARGETS:
            _, rows, width = part_rows(spec)[target]
            block = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{block}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, width, generator=generator) / width**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(rows, rank, generator=generator) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                         "target_modules": list(TARGETS), "bias": "none"}))
    return str(out)


def tokens_per_second(llm: LLM, prompts: list[list[dict]], params: list[SamplingParams]) -> float:
    began = time.perf_counter()
    outputs = llm.chat(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - began)


def measure(args: argparse.Namespace, root: Path) -> dict:
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, enable_lora=True,
              max_loras=args.adapters, max_lora_rank=args.rank, max_num_seqs=max(args.num_prompts, 1))
    for i in range(args.adapters):  # written for the loaded model's shapes, then loaded as a server loads them
        llm.engine.add_lora(f"adapter-{i}", write_adapter(root / f"adapter-{i}", llm.engine.spec, args.rank, i))
    names = list(llm.engine.lora_adapters)
    every = [p.prompt for p in builtin_prompts()]
    prompts = [[{"role": "user", "content": every[i % len(every)]}] for i in range(args.num_prompts)]

    def params(lora: list[str | None]) -> list[SamplingParams]:
        return [SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, lora=name)
                for name in lora]

    arms = {"base": params([None] * len(prompts)),
            f"{args.adapters}_adapters": params([names[i % len(names)] for i in range(len(prompts))]),
            "1_adapter": params([names[0]] * len(prompts))}
    tokens_per_second(llm, prompts[:2], params([None, names[0]]))  # warm: kernels, first allocations
    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    for _ in range(args.rounds):
        for arm, arm_params in arms.items():
            rates[arm].append(tokens_per_second(llm, prompts, arm_params))
            print(f"{arm}: {rates[arm][-1]:.1f} tok/s", flush=True)
    medians = {arm: statistics.median(r) for arm, r in rates.items()}
    return {"machine": machine_record(), "model": args.model, "dtype": str(llm.engine.dtype),
            "quantization": args.quantization, "rank": args.rank, "num_prompts": args.num_prompts,
            "output_len": args.output_len, "tokens_per_second": rates, "medians": medians,
            "over_base": {arm: medians[arm] / medians["base"] for arm in arms if arm != "base"},
            "over_base_by_round": {arm: statistics.median(r / b for r, b in zip(rates[arm], rates["base"], strict=True))
                                   for arm in arms if arm != "base"},
            "lora_bytes": llm.engine.weight_bytes}


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(args, Path(tmp))
    base = result["medians"]["base"]
    print(f"base model alone: {base:.1f} tok/s (median of {args.rounds})")
    for arm, ratio in result["over_base"].items():
        print(f"{arm.replace('_', ' ')}: {result['medians'][arm]:.1f} tok/s, {ratio:.2f}x the base "
              f"({result['over_base_by_round'][arm]:.2f}x by round)")
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(result, indent=2))
    return 0
