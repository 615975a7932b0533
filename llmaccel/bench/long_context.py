"""`llmaccel bench long-context`: what a 32k-token document and a chat whose history passes it cost in memory
and time, with full attention, an INT8 KV cache, a KV window with sinks, and both (issue 45).

Each variant runs in a subprocess of its own, so its peak RSS is its own: first one document of --tokens
tokens of the built-in corpora, generating --output tokens (prefill seconds from the first step to the first
token, decode tok/s after it, the KV blocks the request held at most, and the KV the engine wrote: the pool is
mapped lazily, so that is what is resident; a window's freed blocks stay in the prefix cache, at the back of
the free queue, so a long windowed sequence writes more of the pool than it holds); then a --turns-turn chat
on other text, each turn sending the whole history plus about --tokens / (turns - 1) new tokens, so the last
turn's history passes --tokens (its prefill reuses the cached history where the variant keeps it).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

VARIANTS = {
    "full": {},
    "int8": {"kv_cache_dtype": "int8"},
    "window": {"window": True},
    "window+int8": {"window": True, "kv_cache_dtype": "int8"},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="model alias, GGUF file or HF directory")
    parser.add_argument("--tokens", type=int, default=32768, help="tokens of the document")
    parser.add_argument("--output", type=int, default=64, help="tokens generated after it (and each chat turn)")
    parser.add_argument("--turns", type=int, default=6, help="turns of the chat")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list from {', '.join(VARIANTS)}")
    parser.add_argument("--kv-window", type=int, default=4096, help="the window of the window variants")
    parser.add_argument("--kv-sinks", type=int, default=4, help="their attention sinks")
    parser.add_argument("--kv-cache-memory", default="1536MiB", help="each engine's KV budget (the full cache "
                                                                     "must hold the chat's history)")
    parser.add_argument("--dtype", default="auto", help="the model's dtype")
    parser.add_argument("--quantization", choices=("int8", "int4", "gguf"), help="weight-only quantization")
    parser.add_argument("--result-json", type=Path, help="write every figure to this JSON file")
    parser.add_argument("--worker", choices=tuple(VARIANTS), help=argparse.SUPPRESS)


def _serve(engine, ids: list[int], params) -> tuple[object, int]:
    """One request run to its end, and the most KV blocks in use at once while it ran."""
    engine.add_request(None, ids, params)
    outputs, most = [], 0
    while engine.has_unfinished_requests():
        outputs += engine.step(emit_unfinished=False)
        most = max(most, engine.num_blocks - engine.num_free_blocks)
    return outputs[0], most


def _run_worker(args: argparse.Namespace) -> dict:
    import time

    from llmaccel.bench.datasets import corpus_tokens
    from llmaccel.llm import LLM
    from llmaccel.platform import peak_rss_bytes
    from llmaccel.sampling_params import SamplingParams

    variant = VARIANTS[args.worker]
    options = {"kv_cache_dtype": variant.get("kv_cache_dtype", "auto")}
    if variant.get("window"):
        options.update(kv_window=args.kv_window, kv_sinks=args.kv_sinks)
    started = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, kv_cache_memory=args.kv_cache_memory,
              **options)
    engine = llm.engine
    load = {"load_s": time.perf_counter() - started, "rss_after_load_gib": peak_rss_bytes() / 2**30}
    params = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True)
    document = corpus_tokens(llm.tokenizer, args.tokens)
    out, most = _serve(engine, document, params)
    metrics = out.metrics
    result = {**load, "max_model_len": engine.max_model_len, "kv_bytes_per_token": engine.bytes_per_block
              // engine.kv_cache.block_size,
              "document": {"kv_held_gib": most * engine.bytes_per_block / 2**30,
                           "prefill_s": metrics.first_token_time - metrics.first_scheduled_time,
                           "decode_tok_s": (args.output - 1) / (metrics.finished_time - metrics.first_token_time),
                           "kv_written_gib": engine.memory_bytes["kv_pool_touched"] / 2**30,
                           "peak_rss_gib": peak_rss_bytes() / 2**30}}
    new_per_turn = args.tokens // max(1, args.turns - 1)
    text = corpus_tokens(llm.tokenizer, new_per_turn * args.turns, skip=args.tokens)
    history: list[int] = []
    turns = []
    for turn in range(args.turns):
        history = history + text[turn * new_per_turn:(turn + 1) * new_per_turn]
        if len(history) + args.output > engine.max_model_len:
            turns.append({"history_tokens": len(history), "refused": f"past max_model_len {engine.max_model_len}"})
            break
        out, most = _serve(engine, history, params)
        m = out.metrics
        turns.append({"history_tokens": len(history), "cached_tokens": out.num_cached_tokens,
                      "kv_held_gib": most * engine.bytes_per_block / 2**30,
                      "ttft_s": m.first_token_time - m.arrival_time,
                      "decode_tok_s": (args.output - 1) / (m.finished_time - m.first_token_time)})
        history = history + list(out.outputs[0].token_ids)
    result["chat"] = {"turns": turns, "kv_written_gib": engine.memory_bytes["kv_pool_touched"] / 2**30,
                      "peak_rss_gib": peak_rss_bytes() / 2**30}
    return result


def run(args: argparse.Namespace) -> int:
    if args.worker:
        print(json.dumps(_run_worker(args)))
        return 0
    from tqdm.auto import tqdm

    from llmaccel.platform import machine_record

    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    forwarded = sys.argv[1:]  # the worker takes the same flags (and ignores --result-json)
    results = {}
    for name in tqdm(names, desc="variants", unit="variant"):
        done = subprocess.run([sys.executable, "-m", "llmaccel.cli", *forwarded, "--worker", name],
                              capture_output=True, text=True)
        if done.returncode:
            results[name] = {"failed": done.stderr.strip().splitlines()[-1:] or ["no output"]}
        else:
            results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    print(format_table(results, args))
    if args.result_json:
        record = {"machine": machine_record(), "model": args.model, "settings": {
            k: v for k, v in vars(args).items() if k not in ("func", "result_json", "worker")}, "results": results}
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(record, indent=2, default=str) + "\n")
        print(f"wrote {args.result_json}", file=sys.stderr)
    return 0


def format_table(results: dict[str, dict], args: argparse.Namespace) -> str:
    full = results.get("full", {}).get("document", {}).get("kv_held_gib")
    lines = [f"| variant | KV held for {args.tokens} tokens, GiB (saved vs full) | KV written GiB | peak RSS GiB | "
             "prefill s | decode tok/s | chat: turns, last history tokens | last turn: KV held GiB, TTFT s | "
             "chat peak RSS GiB |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if "failed" in r:
            lines.append(f"| {name} | failed: {r['failed'][0][:120]} |||||||")
            continue
        doc, chat = r["document"], r["chat"]
        saved = f" ({1 - doc['kv_held_gib'] / full:.0%})" if full else ""
        last = chat["turns"][-1]
        lines.append(f"| {name} | {doc['kv_held_gib']:.3f}{saved} | {doc['kv_written_gib']:.3f} | "
                     f"{doc['peak_rss_gib']:.2f} | {doc['prefill_s']:.1f} | {doc['decode_tok_s']:.1f} | "
                     f"{len(chat['turns'])}, {last['history_tokens']} | {last.get('kv_held_gib', float('nan')):.3f}, "
                     f"{last.get('ttft_s', float('nan')):.1f} | {chat['peak_rss_gib']:.2f} |")
    return "\n".join(lines)
