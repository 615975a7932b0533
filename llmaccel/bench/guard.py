"""`llmaccel bench guard`: how often the output guard finds answers anomalous, and how often a hotter
resample fixes them, per served variant, on the built-in chat prompts.

Each variant answers every prompt (through the chat template, batched); every answer is checked
(sample rate 1) by the server's own OutputGuard: its mean per-token KL against the reference (the
full-precision model for a quantized variant; for a float model its raw distribution, so a greedy
float answer scores 0) and, when over the threshold, up to `--retries` resamples at a higher
temperature. On a healthy float model every anomaly is a false one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from llmaccel.quantization.perplexity import VARIANTS

GUARD_VARIANTS = [name for name, options in VARIANTS.items() if "awq" not in options]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="model alias, GGUF file or HF directory")
    parser.add_argument("--variants", default="fp32,int8,int4,int4-g32",
                        help=f"served variants, comma-separated ({', '.join(GUARD_VARIANTS)})")
    parser.add_argument("--num-prompts", type=int, default=200, help="built-in chat prompts answered per variant")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of the answers")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling of the answers")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampled answers")
    parser.add_argument("--guard-kl", type=float, default=0.35, help="the anomaly threshold (mean nats per token)")
    parser.add_argument("--retries", type=int, default=2, help="resamples of an anomalous answer")
    parser.add_argument("--result-json", type=Path, help="write every figure to this JSON file")


def run_variant(args: argparse.Namespace, variant: str, prompts: list[str]) -> dict:
    from llmaccel.llm import LLM
    from llmaccel.safety.output_guard import GuardConfig, OutputGuard
    from llmaccel.sampling_params import SamplingParams
    from llmaccel.server.metrics import ServerMetrics

    llm = LLM(args.model, **VARIANTS[variant])
    tokenizer, engine = llm.tokenizer, llm.engine
    prompt_ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                                 add_generation_prompt=True), add_special_tokens=False)
                  for p in prompts]
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.seed if args.temperature > 0 else None)
    start = time.perf_counter()
    answers = [out.outputs[0] for out in llm.generate(prompt_ids, params, use_tqdm=False)]

    async def measure(prompt, output, sampling):
        return engine.divergence(prompt, output, sampling)

    guard = OutputGuard(GuardConfig(sample_rate=1.0, max_kl=args.guard_kl, retries=args.retries), measure,
                        ServerMetrics())
    verdicts: dict[str, int] = {"pass": 0, "resampled": 0, "flagged": 0}
    first_kls = []

    async def review_all() -> None:
        for ids, answer in zip(prompt_ids, answers, strict=True):
            async def regenerate(sampling, ids=ids):
                return llm.generate(ids, sampling, use_tqdm=False)[0].outputs[0]

            report = await guard.review(ids, params, answer, regenerate)
            first_kls.append(report.first_kl)
            verdicts[report.verdict] += 1

    asyncio.run(review_all())
    anomalous = verdicts["resampled"] + verdicts["flagged"]
    kls = sorted(first_kls)
    return {"variant": variant, "answers": len(answers), "anomalous": anomalous,
            "abnormal_ratio": anomalous / len(answers), "resampled": verdicts["resampled"],
            "flagged": verdicts["flagged"], "resample_success_rate": verdicts["resampled"] / anomalous
            if anomalous else None, "kl_p50": kls[len(kls) // 2], "kl_p90": kls[int(len(kls) * 0.9)],
            "kl_max": kls[-1], "seconds": time.perf_counter() - start}


def run(args: argparse.Namespace) -> int:
    from llmaccel.data.prompts import builtin_prompts

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in GUARD_VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(GUARD_VARIANTS)}")
    prompts = [p.prompt for p in builtin_prompts()][: args.num_prompts]
    rows = []
    for variant in variants:
        rows.append(run_variant(args, variant, prompts))
        print(f"{variant}: done in {rows[-1]['seconds']:.0f} s", flush=True)
    print(f"\noutput guard, {args.model}, {len(prompts)} built-in prompts, {args.max_tokens} tokens, temperature "
          f"{args.temperature}, top-p {args.top_p}, threshold {args.guard_kl} nats/token, {args.retries} retries\n")
    print(format_table(rows))
    if args.result_json:
        args.result_json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()
                                                         if k not in ("func",)}, "rows": rows}, indent=2) + "\n")
    return 0


def format_table(rows: list[dict]) -> str:
    lines = ["| variant | answers | anomalous | abnormal ratio | resampled ok | flagged | resample success | "
             "KL p50 | KL p90 | KL max |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        success = "-" if r["resample_success_rate"] is None else f"{r['resample_success_rate'] * 100:.1f}%"
        lines.append(f"| {r['variant']} | {r['answers']} | {r['anomalous']} | {r['abnormal_ratio'] * 100:.1f}% | "
                     f"{r['resampled']} | {r['flagged']} | {success} | {r['kl_p50']:.4f} | {r['kl_p90']:.4f} | "
                     f"{r['kl_max']:.4f} |")
    return "\n".join(lines)
