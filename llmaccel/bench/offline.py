"""`llmaccel bench offline`: the same prompts through HF transformers and llmaccel, in one run.

(a) HF `generate` one request at a time, (b) HF static batches (left padding; a batch runs until
its longest target, so shorter requests waste their slots), (c) llmaccel. Every request generates
exactly its target length (EOS ignored) and only target tokens count as output. Each system runs
in its own subprocess so its peak memory (max RSS) is its own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from llmaccel.platform import machine_record, peak_rss_bytes

SYSTEMS = ("hf-sequential", "hf-static-batch", "llmaccel")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="model alias, GGUF file or HF directory")
    parser.add_argument("--num-prompts", type=int, default=64, help="how many built-in prompts to run")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--output-len", type=int, help="every request generates exactly this many tokens")
    group.add_argument("--output-len-dist", action="store_true",
                       help="each request generates its prompt's built-in target length (the default)")
    parser.add_argument("--hf-batch-size", type=int, default=None, help="HF static batch size (default: all prompts)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list from {', '.join(SYSTEMS)}")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="llmaccel KV cache budget")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="llmaccel max sequences per step")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="llmaccel token budget per step")
    parser.add_argument("--dtype", default="auto", help="llmaccel's dtype (auto: the machine's fast one)")
    parser.add_argument("--quantization", choices=("int8", "int4", "gguf"), help="llmaccel's weight-only quantization")
    parser.add_argument("--quantize-embedding", action="store_true", help="llmaccel: embedding and LM head in INT8")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run every system this many times, alternating, and report medians (noisy machines)")
    parser.add_argument("--result-json", type=Path, help="write all figures to this JSON file")
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)


def _workload(args: argparse.Namespace, tokenizer) -> tuple[list[list[int]], list[int]]:
    from llmaccel.data.prompts import builtin_prompts

    prompts = builtin_prompts()
    if args.num_prompts > len(prompts):
        raise SystemExit(f"--num-prompts {args.num_prompts}: the built-in set has {len(prompts)} prompts")
    chosen = prompts[: args.num_prompts]
    ids = []
    for p in chosen:
        text = tokenizer.apply_chat_template([{"role": "user", "content": p.prompt}], tokenize=False,
                                             add_generation_prompt=True)
        ids.append(tokenizer.encode(text, add_special_tokens=False))
    targets = [args.output_len or p.output_len for p in chosen]
    return ids, targets


def _run_worker(args: argparse.Namespace) -> dict:
    import torch

    from llmaccel.model.loader import hf_dir_for, load_tokenizer, model_files_dir

    # only the HF baselines need the weights as a float directory (a GGUF file converted: a 1.8 GB Q4_K_M
    # file is a 12 GB float32 copy); llmaccel reads such a file in place and needs the tokenizer alone
    hf_dir = model_files_dir(args.model) if args.worker == "llmaccel" else hf_dir_for(args.model)
    tokenizer = load_tokenizer(hf_dir)
    prompt_ids, targets = _workload(args, tokenizer)
    if args.worker == "llmaccel":
        from llmaccel.llm import LLM
        from llmaccel.sampling_params import SamplingParams

        llm = LLM(args.model, kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype,
                  quantization=args.quantization, quantize_embedding=args.quantize_embedding)
        llm.generate([prompt_ids[0]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
        params = [SamplingParams(temperature=0, max_tokens=t, ignore_eos=True) for t in targets]
        before = replace(llm.engine.prefix_cache_stats)
        start = time.perf_counter()
        outputs = llm.generate(prompt_ids, params, use_tqdm=True)
        wall = time.perf_counter() - start
        after = llm.engine.prefix_cache_stats
        extra = {"prefix_cache_queries": after.queries - before.queries, "prefix_cache_hits": after.hits - before.hits,
                 "weight_bytes": _streamed_bytes(llm), "dtype": str(llm.engine.dtype).removeprefix("torch.")}
        produced = [len(o.outputs[0].token_ids) for o in outputs]
        assert produced == targets, "llmaccel did not generate the target lengths"
        generated = sum(produced)
    else:
        from transformers import AutoModelForCausalLM, GenerationConfig

        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # every request runs to its target length
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

        def generate(batch: list[list[int]], new_tokens: int) -> None:
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                      eos_token_id=None, pad_token_id=pad)
            with torch.no_grad():
                model.generate(ids, attention_mask=mask, generation_config=config)

        extra = {}
        generate([prompt_ids[0]], 4)  # warm-up
        from tqdm.auto import tqdm

        start = time.perf_counter()
        generated = 0
        if args.worker == "hf-sequential":
            for ids, target in tqdm(list(zip(prompt_ids, targets, strict=True)), desc="hf one at a time"):
                generate([ids], target)
                generated += target
        else:
            size = args.hf_batch_size or len(prompt_ids)
            for i in tqdm(range(0, len(prompt_ids), size), desc="hf static batches"):
                batch_targets = targets[i:i + size]
                generate(prompt_ids[i:i + size], max(batch_targets))
                generated += max(batch_targets) * len(batch_targets)
        wall = time.perf_counter() - start
    useful = sum(targets)
    return {"system": args.worker, "wall_s": wall, "output_tokens": useful, "generated_tokens": generated,
            "output_tokens_per_s": useful / wall, "prompt_tokens": sum(len(p) for p in prompt_ids),
            "peak_rss_bytes": peak_rss_bytes(),
            "num_prompts": len(prompt_ids), "targets_median": statistics.median(targets), "targets_max": max(targets),
            **extra}


def run(args: argparse.Namespace) -> int:
    if args.worker:
        print("RESULT " + json.dumps(_run_worker(args)), flush=True)
        return 0
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"--systems: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SYSTEMS)}")
    argv = sys.argv[1:]
    forwarded = argv[argv.index("offline") + 1:] if "offline" in argv else []
    runs: dict[str, list[dict]] = {system: [] for system in systems}
    for round_index in range(max(1, args.repeat)):
        for system in systems:  # alternate systems, so slow drifts of the machine hit both alike
            print(f"== {system} (run {round_index + 1}/{max(1, args.repeat)})", file=sys.stderr, flush=True)
            proc = subprocess.run([sys.executable, "-m", "llmaccel.cli", "bench", "offline", *forwarded,
                                   "--worker", system], stdout=subprocess.PIPE, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise SystemExit(f"{system} failed (exit {proc.returncode})")
            runs[system].append(json.loads(lines[-1][len("RESULT "):]))
    results = [_median_run(runs[system]) for system in systems]
    machine = machine_record()
    _print_table(results, args)
    _print_ceiling(results, machine)
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                "machine": machine, "results": results}, indent=2))
    return 0


def _streamed_bytes(llm) -> int:
    """Weight bytes one decode step reads: every weight, less the embedding table where the LM head has
    its own copy (a lookup reads one row of it)."""
    from llmaccel.model.layers import weight_bytes

    model = llm.engine.runner.model
    return llm.engine.weight_bytes - (0 if model.lm_head is model.embedding else weight_bytes(model.embedding))


def _print_ceiling(results: list[dict], machine: dict) -> None:
    """For one request, decode streams every weight once a token: the measured read bandwidth over the
    weight bytes is the ceiling no engine passes."""
    print(f"machine: {machine['cpu']} ({', '.join(machine['features']) or 'no listed features'}), "
          f"read bandwidth {machine['read_bandwidth_gbps']} GB/s")
    for r in results:
        if r.get("weight_bytes") and r["num_prompts"] == 1:
            ceiling = machine["read_bandwidth_gbps"] * 1e9 / r["weight_bytes"]
            r["bandwidth_ceiling_tok_s"] = round(ceiling, 1)
            print(f"{r['system']} ({r['dtype']}): {r['weight_bytes'] / 2**20:.0f} MiB of weights read a token, ceiling "
                  f"{ceiling:.1f} tok/s; this run {r['output_tokens_per_s'] / ceiling:.0%} of it")


def _median_run(runs: list[dict]) -> dict:
    """The run with the median wall time, plus every run's wall time."""
    ordered = sorted(runs, key=lambda r: r["wall_s"])
    median = dict(ordered[(len(ordered) - 1) // 2])
    median["all_wall_s"] = [r["wall_s"] for r in runs]
    median["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in runs)
    return median


def _print_table(results: list[dict], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    base = {r["system"]: r for r in results}
    seq = base.get("hf-sequential")
    static = base.get("hf-static-batch")
    workload = f"output-len {args.output_len}" if args.output_len else "output-len-dist"
    table = Table(title=f"{results[0]['num_prompts']} prompts, {workload}, {results[0]['output_tokens']} output tokens")
    for column in ("system", "wall s", "output tok/s", "vs HF one-at-a-time", "vs HF static batch", "peak RSS"):
        table.add_column(column, justify="right")
    for r in results:
        ratio_seq = f"{r['output_tokens_per_s'] / seq['output_tokens_per_s']:.2f}x" if seq else "-"
        ratio_static = f"{r['output_tokens_per_s'] / static['output_tokens_per_s']:.2f}x" if static else "-"
        table.add_row(r["system"], f"{r['wall_s']:.1f}", f"{r['output_tokens_per_s']:.1f}", ratio_seq, ratio_static,
                      f"{r['peak_rss_bytes'] / 2**20:.0f} MiB")
    Console(width=120).print(table)
    for r in results:
        if r.get("prefix_cache_queries"):
            print(f"{r['system']}: prefix cache hits {r['prefix_cache_hits']} of {r['prefix_cache_queries']} prompt "
                  f"tokens ({r['prefix_cache_hits'] / r['prefix_cache_queries']:.0%})")
