"""`llmaccel bench kv`: the KV cache's element types side by side in one process (issue 45).

For each --kv-cache-dtype (the first is the reference): the tokens the same --kv-cache-memory holds; the
perplexity of --ppl-ctx-token windows of each corpus; how many greedy continuations of the built-in chat
prompts, run as one batch, stay identical to the reference's; decode throughput of a batch of short chats;
and decode throughput at a long context (--long-requests prompts of --long-context tokens, prefilled once,
then continued from the prefix cache so the timed part is decode reading the long KV). The reference's own
continuations run one at a time against its batch give the noise floor of the agreement: in bf16 a row's
sums depend on the batch it shares (issue 50), so even the reference does not repeat itself exactly.
Timed runs alternate between the types, --repeat times, and report medians, so the VM's drift weighs on
each alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

from llmaccel.platform import machine_record, peak_rss_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="model alias, GGUF file or HF directory")
    parser.add_argument("--kv-dtypes", default="auto,int8", help="comma list of --kv-cache-dtype values; the first "
                                                                 "is the reference the others are compared with")
    parser.add_argument("--dtype", default="auto", help="the model's dtype")
    parser.add_argument("--quantization", choices=("int8", "int4", "gguf"), help="weight-only quantization")
    parser.add_argument("--kv-cache-memory", default="2GiB", help="each engine's KV budget")
    parser.add_argument("--corpus", action="append", help="perplexity corpora (named or a file; default enwiki and "
                                                          "sanguo); --no-quality skips them")
    parser.add_argument("--ppl-ctx", type=int, default=4096, help="perplexity window in tokens")
    parser.add_argument("--ppl-tokens", type=int, default=16384, help="tokens of each corpus scored")
    parser.add_argument("--agreement-prompts", type=int, default=64, help="greedy continuations compared")
    parser.add_argument("--agreement-tokens", type=int, default=128, help="tokens of each continuation")
    parser.add_argument("--no-quality", action="store_true",
                        help="speed and capacity only (random-weight checkpoints: their text means nothing)")
    parser.add_argument("--batch", type=int, default=64, help="requests of the short-chat decode run")
    parser.add_argument("--batch-tokens", type=int, default=128, help="tokens each of them generates")
    parser.add_argument("--long-context", type=int, default=4096, help="prompt tokens of the long-context run")
    parser.add_argument("--long-requests", type=int, default=8, help="requests of the long-context run")
    parser.add_argument("--long-tokens", type=int, default=64, help="tokens each long request generates")
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds per type, alternating")
    parser.add_argument("--result-json", type=Path, help="write every figure to this JSON file")


def _chat_prompts(llm, count: int) -> list[list[int]]:
    from llmaccel.data.prompts import builtin_prompts

    return [llm.apply_chat_template([{"role": "user", "content": p.prompt}]) for p in builtin_prompts()[:count]]


def _long_prompts(llm, length: int, count: int) -> list[list[int]]:
    """`count` different `length`-token stretches of the built-in corpora."""
    from llmaccel.bench.datasets import corpus_tokens

    ids = corpus_tokens(llm.tokenizer, length * count)
    return [ids[i * length:(i + 1) * length] for i in range(count)]


def _tokens_per_second(llm, prompts: list[list[int]], tokens: int) -> float:
    from llmaccel.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return len(prompts) * tokens / (time.perf_counter() - start)


def _agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """The share of identical continuations and where the others first differ."""
    firsts = [next((i for i, (a, b) in enumerate(zip(r, o, strict=True)) if a != b), None)
              for r, o in zip(reference, other, strict=True)]
    differing = [f for f in firsts if f is not None]
    return {"identical": sum(f is None for f in firsts) / len(firsts),
            "first_difference_median": statistics.median(differing) if differing else None,
            "tokens_agreeing": sum(sum(a == b for a, b in zip(r, o, strict=True))
                                   for r, o in zip(reference, other, strict=True)) / sum(map(len, reference))}


def run(args: argparse.Namespace) -> int:
    from llmaccel.llm import LLM
    from llmaccel.quantization.perplexity import perplexity
    from llmaccel.sampling_params import SamplingParams

    names = [n.strip() for n in args.kv_dtypes.split(",") if n.strip()]
    engines = {name: LLM(args.model, dtype=args.dtype, quantization=args.quantization, kv_cache_dtype=name,
                         kv_cache_memory=args.kv_cache_memory) for name in names}
    rows = {}
    for name, llm in engines.items():
        engine = llm.engine
        rows[name] = {"kv_dtype": str(engine.kv_dtype).removeprefix("torch."),
                      "capacity_tokens": engine.num_blocks * engine.kv_cache.block_size,
                      "kv_bytes_per_token": engine.bytes_per_block // engine.kv_cache.block_size}
    reference = names[0]
    if not args.no_quality:
        corpora = args.corpus or ["enwiki", "sanguo"]
        from llmaccel.data.corpora import load_corpus

        texts = {c: load_corpus(c) for c in corpora}
        for name, llm in engines.items():
            for corpus, text in texts.items():
                result = perplexity(llm.engine, text, args.ppl_tokens, args.ppl_ctx, args.ppl_ctx // 2)
                rows[name][f"ppl_{corpus}"] = result.perplexity
        prompts = _chat_prompts(engines[reference], args.agreement_prompts)
        params = SamplingParams(temperature=0, max_tokens=args.agreement_tokens, ignore_eos=True)
        outputs = {name: [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
                   for name, llm in engines.items()}
        for name in names:
            rows[name]["agreement"] = _agreement(outputs[reference], outputs[name])
        # the noise floor: the reference's own continuations run one at a time against its batch
        alone = [engines[reference].generate([p], params, use_tqdm=False)[0].outputs[0].token_ids
                 for p in tqdm(prompts, desc="reference one at a time", unit="prompt")]
        rows[reference]["agreement_alone_vs_batch"] = _agreement(outputs[reference], alone)
    short = _chat_prompts(engines[reference], args.batch)
    long = _long_prompts(engines[reference], args.long_context, args.long_requests)
    for llm in engines.values():  # warm-up, and the long prompts into each prefix cache
        llm.generate(short[:1], SamplingParams(max_tokens=4), use_tqdm=False)
        llm.generate(long, SamplingParams(max_tokens=1), use_tqdm=False)
    timings: dict[str, dict[str, list[float]]] = {name: {"batch": [], "long": []} for name in names}
    for _ in tqdm(range(args.repeat), desc="timed rounds", unit="round"):
        for name, llm in engines.items():
            timings[name]["batch"].append(_tokens_per_second(llm, short, args.batch_tokens))
            timings[name]["long"].append(_tokens_per_second(llm, long, args.long_tokens))
    for name in names:
        rows[name]["batch_tok_s"] = statistics.median(timings[name]["batch"])
        rows[name]["long_tok_s"] = statistics.median(timings[name]["long"])
        rows[name]["rounds"] = timings[name]
    print(format_table(rows, reference, args))
    if "agreement_alone_vs_batch" in rows[reference]:
        floor = rows[reference]["agreement_alone_vs_batch"]
        print(f"noise floor: {reference}'s own continuations one at a time against its batch: {floor['identical']:.0%} "
              f"identical, {floor['tokens_agreeing']:.1%} of tokens agreeing")
    if args.result_json:
        record = {"machine": machine_record(), "model": args.model, "dtype": args.dtype,
                  "quantization": args.quantization, "kv_cache_memory": args.kv_cache_memory,
                  "settings": {k: v for k, v in vars(args).items() if k not in ("func", "result_json")},
                  "peak_rss_gib": peak_rss_bytes() / 2**30, "results": rows}
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(record, indent=2, default=str) + "\n")
        print(f"wrote {args.result_json}", file=sys.stderr)
    return 0


def format_table(rows: dict[str, dict], reference: str, args: argparse.Namespace) -> str:
    base = rows[reference]
    lines = ["| KV cache | bytes a token | tokens in the pool (x ref) | "
             + "".join(f"ppl {k.removeprefix('ppl_')} @{args.ppl_ctx} (x ref) | " for k in base if k.startswith("ppl_"))
             + ("greedy continuations identical | tokens agreeing | " if "agreement" in base else "")
             + f"decode tok/s, {args.batch} x {args.batch_tokens} (x ref) | "
             + f"decode tok/s, {args.long_requests} x {args.long_tokens} at {args.long_context} (x ref) |"]
    lines.append("|" + "---|" * (lines[0].count("|") - 1))
    for name, row in rows.items():
        cells = [f"{name} ({row['kv_dtype']})", str(row["kv_bytes_per_token"]),
                 f"{row['capacity_tokens']} ({row['capacity_tokens'] / base['capacity_tokens']:.2f}x)"]
        cells += [f"{row[k]:.3f} ({row[k] / base[k]:.4f}x)" for k in base if k.startswith("ppl_")]
        if "agreement" in row:
            agreement = row["agreement"]
            cells += [f"{agreement['identical']:.0%}", f"{agreement['tokens_agreeing']:.1%}"]
        cells += [f"{row[k]:.1f} ({row[k] / base[k]:.3f}x)" for k in ("batch_tok_s", "long_tok_s")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
