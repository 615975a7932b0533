"""A/B of oneDNN row bucketing (ops/cpu_linear.row_bucket) on the default model, one variant per process.

    for v in bucketed exact bucketed exact; do python tools/row_bucket_ab.py $v; done

Each run prints one JSON line: tokens/s for 64 chat prompts x 128 tokens at once, for 128 chat prompts
at their built-in lengths, for one request of 100 tokens, and the process RSS before and after.
Run the variants alternately on a quiet machine and compare medians (docs/robustness.md).
"""

from __future__ import annotations

import json
import sys
import time

import llmaccel.ops.cpu_linear as cpu_linear
from llmaccel.data.prompts import builtin_prompts
from llmaccel.llm import LLM
from llmaccel.platform import describe
from llmaccel.sampling_params import SamplingParams


def rss_gib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**30


def tokens_per_second(llm: LLM, prompts: list, params) -> tuple[float, int]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return tokens / (time.perf_counter() - start), tokens


def main(variant: str) -> None:
    if variant == "exact":
        cpu_linear.row_bucket = lambda rows: rows
    elif variant != "bucketed":
        raise SystemExit("variant: bucketed or exact")
    llm = LLM()
    prompts = builtin_prompts()

    def chat(text: str) -> list[int]:
        return llm.apply_chat_template([{"role": "user", "content": text}])

    llm.generate([chat("Hello")], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm up
    before = rss_gib()
    at_once, _ = tokens_per_second(llm, [chat(p.prompt) for p in prompts[:64]],
                                   SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
    mixed, mixed_tokens = tokens_per_second(
        llm, [chat(p.prompt) for p in prompts[64:192]],
        [SamplingParams(temperature=0, max_tokens=p.output_len, ignore_eos=True) for p in prompts[64:192]])
    single, _ = tokens_per_second(llm, [chat(prompts[0].prompt)],
                                  SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    print(json.dumps({"variant": variant, "machine": describe(), "w2_tok_s": round(at_once, 1),
                      "mixed_tok_s": round(mixed, 1), "mixed_tokens": mixed_tokens, "single_tok_s": round(single, 1),
                      "rss_gib_before": round(before, 3), "rss_gib_after": round(rss_gib(), 3)}))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bucketed")
