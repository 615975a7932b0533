"""`llmaccel bench structured`: what grammar-constrained requests cost a batch, in one process.

64 chat prompts decode together (greedy, as the issue asks: half of them constrained, against none):
- none: every request free, 128 tokens each (EOS ignored);
- half fixed: half the requests held to a JSON array of at least 100 integers, which no request
  finishes within 128 tokens, so every request decodes exactly 128 tokens and the two workloads do
  the same work but the masks: the ratio is the masks' cost alone;
- half fixed, overlapped masks: the same with the masks filled on a worker thread during the
  forward pass instead of just before it (runner.py does this on a GPU, not on a CPU);
- half nested: half the requests held to a nested object schema (a person with an address), the
  kind of answer a client parses; they finish when their JSON does, so the batch shrinks as they
  do, and its control is "half short": the same requests free, each cut at the length its
  constrained answer had in a first run, so both run batches of the same shape.
Rounds alternate between the workloads on one engine, so a drift of the machine falls on all; the
table gives medians, the ratio of medians to `none`, and the median of each round's ratio
("paired"). With the batch the same at every step, the free requests' tokens must equal theirs in
`none` (a constrained neighbour changes nothing for them), and every finished constrained answer
must parse and match its schema; the exit code says whether both held.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from llmaccel.bench.report import write_result
from llmaccel.data.prompts import builtin_prompts
from llmaccel.llm import LLM
from llmaccel.sampling_params import SamplingParams
from llmaccel.structured.params import StructuredOutputsParams

FIXED = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 100}
NESTED = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "languages", "address"], "additionalProperties": False}
SCHEMAS = {"half fixed": FIXED, "half fixed, overlapped masks": FIXED, "half nested": NESTED}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="alias, GGUF file or HF directory")
    parser.add_argument("--batch-size", type=int, default=64, help="requests decoding together")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per request (free ones: exactly this)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians are reported")
    parser.add_argument("--warmup-rounds", type=int, default=1, help="rounds run first, printed, left out of medians")
    parser.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16")
    parser.add_argument("--result-json", type=Path, help="write the figures and the machine here")


def run(args: argparse.Namespace) -> int:
    import jsonschema  # a test extra: `llmaccel serve` from a plain install imports this module for --help

    llm = LLM(args.model, dtype=args.dtype)
    prompts = [llm.apply_chat_template([{"role": "user", "content": p.prompt}])
               for p in builtin_prompts()[:args.batch_size]]
    free = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    workloads = {"none": [free] * len(prompts)}
    for name, schema in SCHEMAS.items():
        constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                     structured_outputs=StructuredOutputsParams(json=schema))
        workloads[name] = [constrained if i % 2 else free for i in range(len(prompts))]
    # half nested's control: its constrained answers' lengths (greedy: the same in every round), free
    lengths = [len(o.outputs[0].token_ids) for o in llm.generate(prompts, workloads["half nested"], use_tqdm=False)]
    workloads["half short"] = [SamplingParams(temperature=0, max_tokens=lengths[i], ignore_eos=True) if i % 2 else free
                               for i in range(len(prompts))]
    rates: dict[str, list[float]] = {}
    warmup: dict[str, list[float]] = {}
    fill_ms: dict[str, list[float]] = {}
    reference: list[list[int]] | None = None
    identical: dict[str, bool] = {}
    valid = finished = 0
    grammars, runner = llm.engine.grammars, llm.engine.runner
    default_overlap = runner.overlap_masks  # as served: on a CPU the masks are filled before the forward pass
    for round_index in range(args.warmup_rounds + args.rounds):
        warming = round_index < args.warmup_rounds
        for name, params in workloads.items():
            runner.overlap_masks = default_overlap or "overlapped" in name
            seconds_before, calls_before = grammars.fill_seconds, grammars.fill_calls
            began = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            rate = sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - began)
            (warmup if warming else rates).setdefault(name, []).append(rate)
            calls = grammars.fill_calls - calls_before
            if calls and not warming:
                fill_ms.setdefault(name, []).append(1000 * (grammars.fill_seconds - seconds_before) / calls)
            ids = [list(o.outputs[0].token_ids) for o in outputs]
            if name == "none":
                reference = reference or ids
            same = all(ids[i] == reference[i] for i in range(0, len(ids), 2))
            identical[name] = identical.get(name, True) and same
            for i in range(1, len(outputs), 2) if name == "half nested" else ():
                if outputs[i].outputs[0].finish_reason == "stop":
                    finished += 1
                    jsonschema.validate(json.loads(outputs[i].outputs[0].text), NESTED)
                    valid += 1
            print(f"{'warm-up' if warming else 'round'} {round_index + 1} {name:26s} {rate:8.1f} tok/s", flush=True)
    rows = []
    controls = {"half nested": "half short"}  # each workload against the free one of its batch shape
    for name in workloads:
        control = controls.get(name, "none")
        paired = statistics.median(r / b for r, b in zip(rates[name], rates[control], strict=True))
        rows.append({"workload": name, "control": control, "tokens_per_s": statistics.median(rates[name]),
                     "ratio": statistics.median(rates[name]) / statistics.median(rates[control]),
                     "paired_ratio": paired, "rounds": rates[name],
                     "warmup_rounds": warmup.get(name, []), "free_identical": identical[name],
                     "mask_fill_ms_per_step": statistics.median(fill_ms[name]) if name in fill_ms else None})
    print(f"\n{'workload':30s} {'tok/s':>8s} {'control':>11s} {'x control':>9s} {'paired':>7s} "
          f"{'mask fill ms/step':>18s} {'free identical':>15s}")
    for row in rows:
        fill = "" if row["mask_fill_ms_per_step"] is None else f"{row['mask_fill_ms_per_step']:.2f}"
        print(f"{row['workload']:30s} {row['tokens_per_s']:8.1f} {row['control']:>11s} {row['ratio']:8.2f}x "
              f"{row['paired_ratio']:6.2f}x {fill:>18s} {row['free_identical']!s:>15s}")
    print(f"'free identical': the free requests' tokens equal theirs in 'none' (with the same batch at every step "
          f"they must; where constrained requests finish early the batch shrinks and the numerics may move). "
          f"Nested answers finished: {finished}, valid against the schema: {valid}")
    if args.result_json:
        write_result(args.result_json, args, rows=rows, free_identical=identical, nested_finished=finished,
                     nested_valid=valid)
    fixed_same = identical["half fixed"] and identical["half fixed, overlapped masks"]
    return 0 if fixed_same and valid == finished else 1
