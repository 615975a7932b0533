"""`llmaccel bench spec`: speculative decoding against plain decoding, in one process.

Three workloads, each greedy, so the speculative outputs must equal the plain ones token for token
(the table says whether they did):
- lone: one chat prompt x 300 tokens (the seeds' scenario);
- copy: one request at a time to rewrite a paragraph of English Wikipedia (the answer copies its
  input: prompt lookup's case), up to 300 tokens, EOS honoured;
- batch: the built-in chat prompts at once (64 by default) x 128 tokens.
Every engine (plain, --draft, ngram) is loaded once and the rounds alternate between them, so a
change in the machine's speed falls on all; the table gives medians and each one's ratio to plain,
and the median of each round's ratio to plain in that round ("paired").
Warm-up rounds come first and are not in the medians: they pay the one-time costs of a fresh engine
(kernels for the workload's shapes, the policy's first trials at its batch size), which a serving
engine pays once; their figures are printed and kept in the result file.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from llmaccel.bench.compare import SINGLE_PROMPT
from llmaccel.bench.report import write_result
from llmaccel.data.corpora import load_corpus
from llmaccel.data.prompts import builtin_prompts
from llmaccel.llm import LLM
from llmaccel.sampling_params import SamplingParams

COPY_INSTRUCTION = "Rewrite the following paragraph, keeping its meaning and its facts:\n\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="the target model: alias, GGUF file or HF directory")
    parser.add_argument("--draft", action="append", default=[], metavar="DIR",
                        help="a draft model to measure (repeatable), e.g. a student from `llmaccel distill`")
    parser.add_argument("--draft-vocab", type=int, action="append", default=[], metavar="N",
                        help="also measure each --draft with its LM head cut to its N most frequent tokens "
                             "(repeatable; see serve --speculative-draft-vocab)")
    parser.add_argument("--lookup", action="store_true",
                        help="also measure each --draft with prompt lookup first (serve --speculative-lookup)")
    parser.add_argument("--no-ngram", action="store_true", help="leave out the ngram (prompt lookup) method")
    parser.add_argument("--num-speculative-tokens", type=int, default=2, metavar="K", help="drafts per step")
    parser.add_argument("--workloads", default="lone,copy,batch", help="which of lone, copy, batch to run")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians are reported")
    parser.add_argument("--warmup-rounds", type=int, default=1,
                        help="rounds run first and left out of the medians (a fresh engine's one-time costs: "
                             "the speculation policy's first trials at each batch size); printed and saved")
    parser.add_argument("--batch-size", type=int, default=64, help="prompts in the batch workload")
    parser.add_argument("--copy-paragraphs", type=int, default=3, help="paragraphs rewritten per copy round")
    parser.add_argument("--speculative-max-batch", type=int,
                        help="fix the policy's batch limit (default: the measured policy, as served)")
    parser.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="every engine with --batch-invariant (a verify step's rows then round as lone ones)")
    parser.add_argument("--result-json", type=Path, help="write the figures and the machine here")


def copy_prompts(count: int, words: int = 90) -> list[str]:
    """`count` paragraphs of ~`words` words from English Wikipedia, as rewrite requests."""
    paragraphs = [p.strip() for p in load_corpus("enwiki").split("\n") if len(p.split()) >= words]
    chosen = [" ".join(p.split()[:words]) for p in paragraphs[:count]]
    return [COPY_INSTRUCTION + p for p in chosen]


def workloads(names: list[str], batch_size: int, copy_paragraphs: int) -> dict[str, tuple[list, SamplingParams]]:
    """name -> (conversations, params); the copy workload's requests run one at a time."""
    chosen = {}
    if "lone" in names:
        chosen["lone"] = ([[{"role": "user", "content": SINGLE_PROMPT}]],
                          SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
    if "copy" in names:
        chosen["copy"] = ([[{"role": "user", "content": p}] for p in copy_prompts(copy_paragraphs)],
                          SamplingParams(temperature=0, max_tokens=300))
    if "batch" in names:
        prompts = builtin_prompts()[:batch_size]
        chosen["batch"] = ([[{"role": "user", "content": p.prompt}] for p in prompts],
                           SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
    return chosen


def measure(llm: LLM, name: str, conversations: list, params: SamplingParams) -> tuple[float, list[list[int]]]:
    """tokens/s and the outputs; the copy workload one request at a time, the others together."""
    groups = [[c] for c in conversations] if name == "copy" else [conversations]
    began, outputs = time.perf_counter(), []
    for group in groups:
        outputs.extend(llm.chat(group, params, use_tqdm=False))
    seconds = time.perf_counter() - began
    ids = [list(o.outputs[0].token_ids) for o in outputs]
    return sum(map(len, ids)) / seconds, ids


def run(args: argparse.Namespace) -> int:
    variants: dict[str, dict] = {"plain": {}}
    common = dict(num_speculative_tokens=args.num_speculative_tokens,
                  speculative_max_batch=args.speculative_max_batch)
    for draft in args.draft:
        variants[f"draft {Path(draft).name}"] = dict(speculative_model=draft, **common)
        for size in args.draft_vocab:
            variants[f"draft {Path(draft).name} vocab {size}"] = dict(speculative_model=draft,
                                                                      speculative_draft_vocab=size, **common)
        if args.lookup:
            variants[f"draft {Path(draft).name} + lookup"] = dict(speculative_model=draft, speculative_lookup=True,
                                                                  **common)
    if not args.no_ngram:
        variants["ngram"] = dict(speculative_method="ngram", **common)
    engines = {label: LLM(args.model, dtype=args.dtype, batch_invariant=args.batch_invariant, **options)
               for label, options in variants.items()}
    chosen = workloads([w.strip() for w in args.workloads.split(",")], args.batch_size, args.copy_paragraphs)
    rates: dict[tuple[str, str], list[float]] = {}
    identical: dict[tuple[str, str], bool] = {}
    for llm in engines.values():  # warm-up: kernels, the policy's first measurements
        measure(llm, "lone", [[{"role": "user", "content": "Hello"}]], SamplingParams(temperature=0, max_tokens=16))
    warmup: dict[tuple[str, str], list[float]] = {}
    for round_index in range(args.warmup_rounds + args.rounds):
        warming = round_index < args.warmup_rounds
        for name, (conversations, params) in chosen.items():
            reference = None
            for label, llm in engines.items():
                rate, ids = measure(llm, name, conversations, params)
                (warmup if warming else rates).setdefault((name, label), []).append(rate)
                if label == "plain":
                    reference = ids
                else:
                    identical[(name, label)] = identical.get((name, label), True) and ids == reference
                kind = "warm-up" if warming else "round"
                number = round_index + 1 if warming else round_index - args.warmup_rounds + 1
                print(f"{kind} {number} {name:5s} {label:24s} {rate:8.1f} tok/s", flush=True)
    rows = []
    for name in chosen:
        base = statistics.median(rates[(name, "plain")])
        for label, llm in engines.items():
            median = statistics.median(rates[(name, label)])
            stats = llm.engine.speculation_stats
            # each round's ratio to plain's rate in the same round: the machine's drift between rounds
            # (plain alone moved 1,498-1,735 tok/s over five rounds of 64) falls out
            paired = statistics.median(r / b for r, b in zip(rates[(name, label)], rates[(name, "plain")], strict=True))
            rows.append({"workload": name, "variant": label, "tokens_per_s": median, "ratio": median / base,
                         "paired_ratio": paired,
                         "rounds": rates[(name, label)], "warmup_rounds": warmup.get((name, label), []),
                         "identical": identical.get((name, label)),
                         "mean_accepted_length": stats.mean_accepted_length if stats else None})
    print(f"\n{'workload':8s} {'variant':28s} {'tok/s':>8s} {'x plain':>8s} {'paired':>7s} {'identical':>9s}")
    for row in rows:
        same = "" if row["identical"] is None else str(row["identical"])
        print(f"{row['workload']:8s} {row['variant']:28s} {row['tokens_per_s']:8.1f} {row['ratio']:8.2f}x "
              f"{row['paired_ratio']:6.2f}x {same:>9s}")
    for label, llm in engines.items():
        stats = llm.engine.speculation_stats
        if stats is not None and stats.num_drafts:
            print(f"{label}: {stats.num_draft_tokens} drafts proposed, {stats.num_accepted_tokens} kept "
                  f"({stats.num_accepted_tokens / stats.num_draft_tokens:.0%}); mean accepted length "
                  f"{stats.mean_accepted_length:.2f}; kept by position {stats.accepted_per_position}")
    if args.result_json:
        write_result(args.result_json, args, rows=rows)
    return 0 if all(identical.values()) else 1
