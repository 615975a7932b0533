"""A distilled student against its teacher in llmaccel's engine: tokens/s at batch 1 and a batch, weight memory,
and how often their greedy answers to the built-in chat prompts agree (`llmaccel bench student`).

Both models are loaded once and measured in alternating rounds in one process (teacher, student, teacher, ...),
so a change in the machine's speed falls on both; the table gives the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from llmaccel.data.prompts import builtin_prompts
from llmaccel.llm import LLM
from llmaccel.platform import machine_record
from llmaccel.sampling_params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--teacher", default="smollm2-135m", help="the teacher (alias, GGUF file or HF directory)")
    parser.add_argument("--student", required=True, help="the student's directory (llmaccel distill --out)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of both measurements")
    parser.add_argument("--single-tokens", type=int, default=300, help="tokens of the lone request (batch 1)")
    parser.add_argument("--batch", type=int, default=64, help="prompts at once for the batch figure")
    parser.add_argument("--batch-tokens", type=int, default=128, help="tokens a prompt in the batch figure")
    parser.add_argument("--answers", type=int, default=64, help="built-in prompts whose greedy answers are compared")
    parser.add_argument("--answer-tokens", type=int, default=64, help="longest greedy answer compared")
    parser.add_argument("--dtype", default="auto", help="the engine's dtype for both")
    parser.add_argument("--result-json", help="write the figures here")


def tokens_per_second(llm: LLM, conversations: list[list[dict]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    began = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - began)


def greedy_answers(llm: LLM, conversations: list[list[dict]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [list(o.outputs[0].token_ids) for o in llm.chat(conversations, params, use_tqdm=False)]


def agreement(teacher: list[list[int]], student: list[list[int]]) -> dict[str, float]:
    """Identical answers, and the mean share of the teacher's answer the student repeats before it first differs."""
    same = sum(t == s for t, s in zip(teacher, student, strict=True))
    prefix = []
    for t, s in zip(teacher, student, strict=True):
        common = next((i for i, (a, b) in enumerate(zip(t, s, strict=False)) if a != b), min(len(t), len(s)))
        prefix.append(common / max(len(t), 1))
    return {"identical_answers": same / len(teacher), "mean_common_prefix_share": statistics.mean(prefix)}


def measure(args: argparse.Namespace) -> dict:
    """Both models' rates (every round), weight bytes and greedy agreement, with the machine."""
    prompts = [[{"role": "user", "content": p.prompt}] for p in builtin_prompts()]
    models = {"teacher": LLM(args.teacher, dtype=args.dtype), "student": LLM(args.student, dtype=args.dtype)}
    for llm in models.values():  # warm both: kernels, first allocations
        tokens_per_second(llm, prompts[:2], 8)
    batch = f"batch_{args.batch}"
    rates: dict[str, dict[str, list[float]]] = {name: {"batch_1": [], batch: []} for name in models}
    for _ in range(args.rounds):
        for name, llm in models.items():
            rates[name]["batch_1"].append(tokens_per_second(llm, prompts[:1], args.single_tokens))
            rates[name][batch].append(tokens_per_second(llm, prompts[:args.batch], args.batch_tokens))
    answers = {name: greedy_answers(llm, prompts[:args.answers], args.answer_tokens) for name, llm in models.items()}
    return {
        "machine": machine_record(), "teacher": args.teacher, "student": args.student, "dtype": args.dtype,
        "tokens_per_second": rates,
        "medians": {name: {k: statistics.median(v) for k, v in r.items()} for name, r in rates.items()},
        "weight_bytes": {name: llm.engine.weight_bytes for name, llm in models.items()},
        "greedy_agreement": agreement(answers["teacher"], answers["student"]),
    }


def run(args: argparse.Namespace) -> int:
    result = measure(args)
    medians = result["medians"]
    for key in ("batch_1", f"batch_{args.batch}"):
        print(f"{key}: teacher {medians['teacher'][key]:.1f} tok/s, student {medians['student'][key]:.1f} tok/s "
              f"({medians['student'][key] / medians['teacher'][key]:.2f}x)")
    print("greedy answers:", result["greedy_agreement"])
    if args.result_json:
        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_json).write_text(json.dumps(result, indent=1), encoding="utf-8")
    return 0
