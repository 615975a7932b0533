"""`llmaccel eval ppl`: sliding-window perplexity, and a side-by-side table of quantized variants.

Perplexity is computed as HF's guide does it: windows of `ctx` tokens that advance by `stride`;
each window scores only the tokens no earlier window scored, with the rest as context. The engine
scores a window in one prefill (`LLMEngine.score`), so every variant runs its real kernels.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from llmaccel.data.corpora import NAMED_CORPORA, load_corpus
from llmaccel.model.layers import weight_bytes
from llmaccel.platform import peak_rss_bytes

# label -> engine options; "int4" uses groups of 32 (the default); "-g64": the coarser grid; "awq": quantize
# with AWQ on the built-in calibration prompts first; "+emb8": the embedding and LM head in INT8 too
VARIANTS = {
    "fp32": {},
    "int8": {"quantization": "int8"},
    "int8+awq": {"quantization": "int8", "awq": True},
    "int8+emb8": {"quantization": "int8", "quantize_embedding": True},
    "int4": {"quantization": "int4"},
    "int4+awq": {"quantization": "int4", "awq": True},
    "int4-g64": {"quantization": "int4", "quant_group_size": 64},
    "int4-g64+awq": {"quantization": "int4", "quant_group_size": 64, "awq": True},
    "int4-g32": {"quantization": "int4", "quant_group_size": 32},
    "int4-g32+emb8": {"quantization": "int4", "quant_group_size": 32, "quantize_embedding": True},
    "gguf-native": {"quantization": "gguf"},  # only for a GGUF model: its own Q4_0/Q4_1/Q8_0 tensors
    "gguf-native+emb8": {"quantization": "gguf", "quantize_embedding": True},  # and its Q8_0 embedding
    "kv-int8": {"kv_cache_dtype": "int8"},  # the weights as they are, the KV cache in INT8 (ops/kv_int8.py)
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="model alias, GGUF file or HF directory")
    parser.add_argument("--quantization", choices=("int8", "int4", "gguf"), help="evaluate this weight-only variant")
    parser.add_argument("--quant-group-size", type=int, help="INT4 group size (default: 32)")
    parser.add_argument("--quantize-embedding", action="store_true", help="the embedding and LM head in INT8 too")
    parser.add_argument("--kv-window", type=int, metavar="W",
                        help="score through a StreamingLLM KV window: each --ctx window goes through in W-token "
                             "chunks that see only the --kv-sinks first tokens and the last W")
    parser.add_argument("--kv-sinks", type=int, default=4, metavar="S", help="attention sinks kept with --kv-window")
    parser.add_argument("--kv-positions", choices=("cache", "absolute"), default="cache",
                        help="with --kv-window: the kept keys at their places in the cache (StreamingLLM) or in the "
                             "text")
    parser.add_argument("--kv-cache-dtype", default="auto", metavar="{auto,int8}",
                        help="the KV cache's element type (int8: every window's keys and values are scored as the "
                             "INT8 cache holds them)")
    parser.add_argument("--corpus", action="append", required=True,
                        help=f"a UTF-8 text file or a named corpus ({', '.join(NAMED_CORPORA)}); repeatable")
    parser.add_argument("--max-tokens", type=int, default=50_000, help="score the first this many tokens")
    parser.add_argument("--ctx", type=int, default=1024, help="window length in tokens")
    parser.add_argument("--stride", type=int, default=512, help="tokens a window advances (<= --ctx)")
    parser.add_argument("--compare", action="store_true",
                        help=f"evaluate every variant ({', '.join(VARIANTS)}) and print a table with weight bytes "
                             "and decode speed")
    parser.add_argument("--variants", help="with --compare: only these variants, comma-separated (fp32, the "
                                           "reference, is always first)")
    parser.add_argument("--no-speed", action="store_true", help="with --compare: skip the decode-speed columns")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


@dataclass
class PerplexityResult:
    perplexity: float
    num_tokens: int
    peak_blocks: int = 0  # the most KV blocks one window held while it was scored


def perplexity(engine, text: str, max_tokens: int, ctx: int, stride: int, progress: bool = True) -> PerplexityResult:
    if not 1 <= stride <= ctx:
        raise ValueError(f"--stride must be in [1, --ctx], got stride {stride} and ctx {ctx}")
    if ctx >= engine.max_model_len:
        raise ValueError(f"--ctx {ctx} must be below the model's max_model_len {engine.max_model_len}")
    ids = engine.tokenizer.encode(text, add_special_tokens=False)[:max_tokens]
    if len(ids) < 2:
        raise ValueError("the corpus has fewer than 2 tokens")
    total, count, scored_until, peak_blocks = 0.0, 0, 1, 0  # position 0 has no context and is never scored
    starts = range(0, max(1, len(ids) - 1), stride)
    for begin in tqdm(starts, desc="perplexity", unit="window", disable=not progress):
        end = min(begin + ctx, len(ids))
        logprobs = engine.score(ids[begin:end])  # logprobs[j] scores ids[begin + j + 1]
        peak_blocks = max(peak_blocks, engine.last_score_blocks)
        first_new = scored_until - begin - 1
        total -= sum(logprobs[first_new:])
        count += len(logprobs) - first_new
        scored_until = end
        if end == len(ids):
            break
    return PerplexityResult(math.exp(total / count), count, peak_blocks)


def decode_speed(llm, batch: int, tokens: int = 128) -> float:
    from llmaccel.data.prompts import builtin_prompts
    from llmaccel.sampling_params import SamplingParams

    prompts = [p.prompt for p in builtin_prompts()[:batch]]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    return batch * tokens / (time.perf_counter() - start)


def run(args: argparse.Namespace) -> int:
    variants = _variants(args)
    texts = {name if name in NAMED_CORPORA else Path(name).name: load_corpus(name) for name in args.corpus}
    with_speed = args.compare and not args.no_speed
    rows = []
    for label, options in variants.items():
        llm = _load(args.model, options)
        if label.startswith("fp32"):  # unquantized runs in the model's dtype: bfloat16 where `auto` picks it
            label = f"unquantized ({str(llm.engine.dtype).removeprefix('torch.')})" + label.removeprefix("fp32")
        row = {"variant": label, "weight_bytes": weight_bytes(llm.engine.runner.model)}
        for name, text in texts.items():
            result = perplexity(llm.engine, text, args.max_tokens, args.ctx, args.stride, not args.no_progress)
            row[name] = result
            print(f"{label} {name}: perplexity {result.perplexity:.4f} over {result.num_tokens} tokens; KV blocks "
                  f"held at most {result.peak_blocks}", file=sys.stderr)
        if with_speed:
            row["batch1"], row["batch32"] = decode_speed(llm, 1), decode_speed(llm, 32)
        rows.append(row)
        del llm
    print(format_table(rows, list(texts), with_speed))
    print(f"(peak RSS of this process: {peak_rss_bytes() / 2**30:.2f} GiB)",
          file=sys.stderr)
    return 0


def _variants(args: argparse.Namespace) -> dict[str, dict]:
    """Label -> engine options of every variant to evaluate (one without --compare)."""
    from llmaccel.model.loader import resolve_model_path

    path = resolve_model_path(args.model)
    if not args.compare:
        from llmaccel.quantization.prequantized import read_quantization_config

        options = {"quantization": args.quantization, "quant_group_size": args.quant_group_size,
                   "quantize_embedding": args.quantize_embedding or None, "kv_window": args.kv_window,
                   "kv_sinks": args.kv_sinks if args.kv_window else None,
                   "kv_positions": args.kv_positions if args.kv_window else None,
                   "kv_cache_dtype": args.kv_cache_dtype if args.kv_cache_dtype != "auto" else None}
        saved = read_quantization_config(path) if path.is_dir() else None
        label = args.quantization or (f"{saved['method']} (saved)" if saved else "fp32")
        label += "+emb8" if args.quantize_embedding else ""
        label += f" kv-window {args.kv_window} ({args.kv_positions} positions)" if args.kv_window else ""
        label += f" kv {args.kv_cache_dtype}" if args.kv_cache_dtype != "auto" else ""
        return {label: {k: v for k, v in options.items() if v is not None}}
    is_gguf = path.suffix.lower() == ".gguf"
    variants = {k: v for k, v in VARIANTS.items() if is_gguf or v.get("quantization") != "gguf"}
    if args.variants:
        chosen = ["fp32"] + [v.strip() for v in args.variants.split(",") if v.strip() and v.strip() != "fp32"]
        unknown = [v for v in chosen if v not in variants]
        if unknown:
            raise ValueError(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(variants)}")
        variants = {v: variants[v] for v in chosen}
    return variants


def _load(model: str, options: dict):
    """The LLM for one variant; an AWQ variant is quantized into a temporary checkpoint first."""
    from llmaccel.llm import LLM

    options = dict(options)
    if not options.pop("awq", False):
        return LLM(model, **options)
    import tempfile

    from llmaccel.quantization.checkpoint import AWQOptions, quantize_checkpoint

    with tempfile.TemporaryDirectory(prefix="llmaccel-awq-") as tmp:
        path = quantize_checkpoint(model, options["quantization"], options.get("quant_group_size"),
                                   Path(tmp) / "model", AWQOptions(), options.get("quantize_embedding", False))
        return LLM(str(path))


def format_table(rows: list[dict], corpora: list[str], with_speed: bool) -> str:
    base = rows[0]
    head = ["variant"] + [f"ppl {c}" for c in corpora] + [f"vs {base['variant']} {c}" for c in corpora]
    head += ["weight MiB", "vs " + base["variant"]] + (["batch-1 tok/s", "batch-32 tok/s"] if with_speed else [])
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for row in rows:
        cells = [row["variant"]] + [f"{row[c].perplexity:.3f}" for c in corpora]
        cells += [f"{(row[c].perplexity / base[c].perplexity - 1) * 100:+.2f}%" for c in corpora]
        change = (row["weight_bytes"] / base["weight_bytes"] - 1) * 100
        cells += [f"{row['weight_bytes'] / 2**20:.0f}", f"{change:+.0f}%"]
        if with_speed:
            cells += [f"{row['batch1']:.1f}", f"{row['batch32']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
