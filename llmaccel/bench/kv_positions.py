"""`llmaccel bench kv-positions`: perplexity far past a KV window, with the sinks at their places in the cache
(--kv-positions cache, StreamingLLM) against at their places in the text (absolute), issue 45.

Each corpus's first --multiples[-1] x W tokens go through each form's engine once (`LLMEngine.score`, in W-long
chunks, each seeing the sinks and the last W to 2W tokens). The perplexity "at m x W" is that of the span of
W tokens ending at m x W. Its reference, the perplexity at the window, is the same span read afresh by the same
model with full attention and only the W tokens before it, at positions from 0 (StreamingLLM's "sliding window
with re-computation": the best a window of W can do, and the same amount of context the streaming forms see).
A form that holds its own stays within a few percent of it however far the span lies.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from tqdm.auto import tqdm

FORMS = ("cache", "absolute")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="model alias, GGUF file or HF directory (quality: "
                                                                "real weights only)")
    parser.add_argument("--kv-window", type=int, default=2048, help="the window W")
    parser.add_argument("--kv-sinks", type=int, default=4, help="the attention sinks kept with it")
    parser.add_argument("--multiples", default="2,4,8", help="spans ending at these multiples of W")
    parser.add_argument("--corpus", action="append", help="named corpus or UTF-8 file, repeatable (default: "
                                                          "enwiki and sanguo)")
    parser.add_argument("--dtype", default="auto", help="the model's dtype")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the KV cache's element type")
    parser.add_argument("--result-json", type=Path, help="write every figure to this JSON file")


def span_perplexity(logprobs: list[float], start: int, end: int) -> float:
    """Perplexity of tokens start .. end - 1 from `LLMEngine.score`'s list (entry i predicts token i + 1)."""
    span = logprobs[start - 1:end - 1]
    return math.exp(-sum(span) / len(span))


def run(args: argparse.Namespace) -> int:
    from llmaccel.data.corpora import load_corpus
    from llmaccel.llm import LLM
    from llmaccel.platform import describe

    window, multiples = args.kv_window, [int(m) for m in args.multiples.split(",")]
    length = window * max(multiples)
    common = {"dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype}
    full = LLM(args.model, **common).engine  # the reference: no window, each span with its W tokens before it
    forms = {form: LLM(args.model, kv_window=window, kv_sinks=args.kv_sinks, kv_positions=form,
                       max_model_len=length + 1, **common).engine for form in FORMS}
    rows = []
    for corpus in args.corpus or ["enwiki", "sanguo"]:
        ids = full.tokenizer.encode(load_corpus(corpus), add_special_tokens=False)
        if len(ids) < length:
            raise SystemExit(f"{corpus} has {len(ids)} tokens; --multiples {args.multiples} of --kv-window "
                             f"{window} need {length}")
        ids = ids[:length]
        scored = {form: engine.score(ids) for form, engine in tqdm(forms.items(), desc=f"{corpus}: streaming")}
        for m in tqdm(multiples, desc=f"{corpus}: spans afresh"):
            start = (m - 1) * window
            reference = full.score(ids[start - window:start + window])  # the span and the W tokens before it
            row = {"corpus": corpus, "at": m * window, "multiple": m,
                   "window_ppl": span_perplexity(reference, window, 2 * window)}
            for form in FORMS:
                row[f"{form}_ppl"] = span_perplexity(scored[form], start, start + window)
            rows.append(row)
    print(format_table(rows, window, args.kv_sinks, full.spec.max_position_embeddings))
    if args.result_json:
        machine = describe()
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps({
            "model": args.model, "kv_window": window, "kv_sinks": args.kv_sinks, "dtype": str(full.dtype),
            "kv_cache_dtype": args.kv_cache_dtype, "trained_positions": full.spec.max_position_embeddings,
            "machine": machine, "rows": rows}, indent=2))
    return 0


def format_table(rows: list[dict], window: int, sinks: int, trained: int) -> str:
    lines = [f"window {window}, {sinks} sinks; the model was trained on {trained} positions",
             "| corpus | span ends at | window ppl (afresh) | cache ppl | vs window | absolute ppl | vs window |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        base = row["window_ppl"]
        lines.append(f"| {row['corpus']} | {row['at']} ({row['multiple']}x) | {base:.3f} | {row['cache_ppl']:.3f} | "
                     f"{row['cache_ppl'] / base - 1:+.2%} | {row['absolute_ppl']:.3f} | "
                     f"{row['absolute_ppl'] / base - 1:+.2%} |")
    return "\n".join(lines)
