"""`llmaccel bench invariance`: does a greedy answer change with the load? --batch-invariant against the default
mode, in one process (issue 50).

For each mode, the 64 built-in chat prompts run greedy for --tokens tokens as one batch (the reference), then
each alone, in batches of 2 and 16, with chunked prefill at 32 tokens (an engine whose step budget is 32) and at
2048, and again once the prefix cache holds every prompt (its last token then runs alone): the share of answers
identical to the reference, and where the others first differ. Then the speed of the mode against the default in
rotated rounds: a lone request (1 x --tokens), the batch (64 x --tokens) and a --long-prompt-token prompt's
prefill (one token out): medians and the median of each round's ratio; and the kernels each mode runs (the
default mode's are what the timing at load chose on this machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

MODES = {"default": {}, "batch-invariant": {"batch_invariant": True}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="model alias, GGUF file or HF directory")
    parser.add_argument("--dtype", default="bfloat16", help="the model's dtype (bfloat16: the fast one on AVX512-BF16)")
    parser.add_argument("--prompts", type=int, default=64, help="built-in chat prompts compared")
    parser.add_argument("--tokens", type=int, default=128, help="greedy tokens of each answer")
    parser.add_argument("--long-prompt", type=int, default=2048, help="prompt tokens of the prefill timing")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds, the arms' order rotated each round")
    parser.add_argument("--no-identity", action="store_true", help="time the modes only")
    parser.add_argument("--result-json", type=Path, help="write every figure to this JSON file")


def answers(llm, prompts: list[list[int]], tokens: int, group: int) -> list[list[int]]:
    """Greedy answers, the prompts run `group` at a time."""
    from llmaccel.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    out = []
    for first in range(0, len(prompts), group):
        out += [o.outputs[0].token_ids for o in llm.generate(prompts[first:first + group], params, use_tqdm=False)]
    return out


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """How many answers are identical, of how many, and where the others first differ (bench kv's measure)."""
    from llmaccel.bench.kv_cache import _agreement

    shared = _agreement(reference, other)
    return {"identical": round(shared["identical"] * len(reference)), "of": len(reference),
            "first_difference_median": shared["first_difference_median"]}


def identity(model: str, dtype: str, options: dict, prompts: list[list[int]], tokens: int) -> dict:
    """Each configuration's answers against one batch of all the prompts, in one mode."""
    from tqdm import tqdm

    from llmaccel.llm import LLM

    def engine(**extra):
        return LLM(model, dtype=dtype, enable_prefix_caching=False, **options, **extra)

    base = engine()
    reference = answers(base, prompts, tokens, len(prompts))
    configs = {"alone": (base, 1), "batches of 2": (base, 2), "batches of 16": (base, 16)}
    out = {}
    for name, (llm, group) in tqdm(configs.items(), desc="batch sizes", unit="config"):
        out[name] = agreement(reference, answers(llm, prompts, tokens, group))
    del base
    for budget in (32, 2048):
        out[f"chunked prefill at {budget}"] = agreement(reference, answers(engine(max_num_batched_tokens=budget),
                                                                           prompts, tokens, len(prompts)))
    cached = LLM(model, dtype=dtype, enable_prefix_caching=True, **options)
    answers(cached, prompts, tokens, len(prompts))  # fills the prefix cache
    out["prefix cache warm"] = agreement(reference, answers(cached, prompts, tokens, len(prompts)))
    return out


def timings(model: str, dtype: str, prompts: list[list[int]], tokens: int, long_prompt: int,
            rounds: int) -> dict:
    from llmaccel.bench.datasets import corpus_tokens
    from llmaccel.bench.paired import paired_summary, rotated
    from llmaccel.llm import LLM
    from llmaccel.sampling_params import SamplingParams

    engines = {mode: LLM(model, dtype=dtype, enable_prefix_caching=False, **options)
               for mode, options in MODES.items()}
    long = corpus_tokens(engines["default"].tokenizer, long_prompt)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1)

    def lone(llm) -> float:
        began = time.perf_counter()
        llm.generate(prompts[:1], params, use_tqdm=False)
        return tokens / (time.perf_counter() - began)

    def batch(llm) -> float:
        began = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return len(prompts) * tokens / (time.perf_counter() - began)

    def prefill(llm) -> float:
        began = time.perf_counter()
        llm.generate([long], one, use_tqdm=False)
        return long_prompt / (time.perf_counter() - began)

    workloads = {"lone tok/s": lone, "batch tok/s": batch, f"prefill of {long_prompt} tok/s": prefill}
    for llm in engines.values():  # warm-up
        for run in workloads.values():
            run(llm)
    runs = {name: {mode: [] for mode in MODES} for name in workloads}
    for i in range(rounds):
        for mode in rotated(tuple(MODES), i):
            for name, run in workloads.items():
                runs[name][mode].append(run(engines[mode]))
    speed = {name: {"runs": by_mode, "medians": {m: statistics.median(v) for m, v in by_mode.items()},
                    **paired_summary(by_mode, "default")["batch-invariant"]}
             for name, by_mode in runs.items()}
    speed["kernels"] = {mode: _kernels(llm) for mode, llm in engines.items()}
    return speed


def _kernels(llm) -> str:
    """The bf16 kernels each row count of the layers and the LM head runs (ops/kernel_choice.py)."""
    model = llm.engine.runner.model
    layers, head = model.layers[0].qkv, model.lm_head
    describe = [getattr(m, "bf16_choice", None) for m in (layers, head)]
    return "; ".join(f"{name}: {c.describe()}" for name, c in zip(("layers", "LM head"), describe, strict=True)
                     if c is not None)


def run(args: argparse.Namespace) -> int:
    from llmaccel.bench.kv_cache import _chat_prompts
    from llmaccel.llm import LLM
    from llmaccel.platform import describe

    prompts = _chat_prompts(LLM(args.model, dtype=args.dtype, num_kv_blocks=8), args.prompts)
    result = {"model": args.model, "dtype": args.dtype, "machine": describe(),
              "args": {k: str(v) for k, v in vars(args).items()}, "identity": {}}
    if not args.no_identity:
        for mode, options in MODES.items():
            result["identity"][mode] = identity(args.model, args.dtype, options, prompts, args.tokens)
            print(f"{mode}: " + ", ".join(f"{name} {a['identical']}/{a['of']}"
                                          for name, a in result["identity"][mode].items()), flush=True)
    result["speed"] = timings(args.model, args.dtype, prompts, args.tokens, args.long_prompt, args.rounds)
    for name, row in result["speed"].items():
        if name == "kernels":
            print("kernels: " + " | ".join(f"{mode}: {k}" for mode, k in row.items()))
            continue
        medians = row["medians"]
        print(f"{name}: default {medians['default']:.1f}, batch-invariant {medians['batch-invariant']:.1f} "
              f"({row['paired']:.3f}x by round, 95% interval {row['ci95'][0]:.3f}-{row['ci95'][1]:.3f})")
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(result, indent=2))
    return 0
