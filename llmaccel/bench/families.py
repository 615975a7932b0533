"""`llmaccel bench families`: every model family at one shape, HF transformers against llmaccel, in one run.

No real checkpoint of most families is on this machine (nothing is downloaded), and decode speed depends on
the shape, not the weights' values: so each family gets a random checkpoint from transformers' own config
class at the default model's shape (SmolLM2-135M: 30 layers, hidden 576, 9 heads of 64, 3 KV heads, MLP 1536,
its tokenizer), written once into the cache. Each then runs `bench offline`'s workers: one request x
--one-len tokens (HF one at a time) and --batch prompts x --batch-len tokens (HF static batch), EOS ignored.
Random weights make the text meaningless and the speed real.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from llmaccel.bench.report import write_result
from llmaccel.config import default_cache_dir

FAMILIES = ("llama", "qwen3", "phi3", "gemma", "gemma2", "gemma3", "gpt2")
SHAPE = dict(hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64, intermediate=1536, positions=2048)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--families", default=",".join(FAMILIES), help=f"comma list from {', '.join(FAMILIES)}")
    parser.add_argument("--one-len", type=int, default=128, help="tokens the lone request generates")
    parser.add_argument("--batch", type=int, default=16, help="prompts in the batch workload")
    parser.add_argument("--batch-len", type=int, default=64, help="tokens each batched request generates")
    parser.add_argument("--dtype", default="auto",
                        help="llmaccel's dtype (auto: the machine's fast one); HF runs float32")
    parser.add_argument("--quantization", choices=("int8", "int4"), help="llmaccel's weight-only quantization")
    parser.add_argument("--result-json", type=Path, help="write all figures to this JSON file")


def _config(family: str, vocab: int, tokenizer):
    """The transformers config of `family` at SHAPE."""
    import transformers as tf

    s = SHAPE
    common = dict(vocab_size=vocab, hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                  num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                  max_position_embeddings=s["positions"], bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id or 0)
    if family == "gpt2":
        return tf.GPT2Config(vocab_size=vocab, n_embd=s["hidden"], n_layer=s["layers"], n_head=s["heads"],
                             n_positions=s["positions"], bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id)
    head = dict(head_dim=s["head_dim"])
    return {
        "llama": lambda: tf.LlamaConfig(**common, tie_word_embeddings=True, rope_theta=100000.0),
        "qwen3": lambda: tf.Qwen3Config(**common, **head, tie_word_embeddings=True),
        "phi3": lambda: tf.Phi3Config(**common, tie_word_embeddings=False, sliding_window=None),
        "gemma": lambda: tf.GemmaConfig(**common, **head),
        "gemma2": lambda: tf.Gemma2Config(**common, **head, query_pre_attn_scalar=s["head_dim"], sliding_window=512),
        "gemma3": lambda: tf.Gemma3TextConfig(**common, **head, query_pre_attn_scalar=s["head_dim"],
                                              sliding_window=512),
    }[family]()


def checkpoint(family: str, root: Path) -> Path:
    """The random checkpoint of `family` at SHAPE, made once (with the default model's tokenizer)."""
    out = root / f"{family}-{SHAPE['layers']}x{SHAPE['hidden']}"
    if (out / "llmaccel-complete").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM

    from llmaccel.model.loader import load_tokenizer, model_files_dir

    tokenizer = load_tokenizer(model_files_dir("smollm2-135m"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family, len(tokenizer), tokenizer)).eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "llmaccel-complete").write_text(family + "\n")
    return out


def _worker(model: Path, system: str, prompts: int, length: int, args: argparse.Namespace) -> dict:
    command = [sys.executable, "-m", "llmaccel.cli", "bench", "offline", "--model", str(model), "--num-prompts",
               str(prompts), "--output-len", str(length), "--dtype", args.dtype, "--worker", system]
    if args.quantization:
        command += ["--quantization", args.quantization]
    proc = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{model.name}: {system} failed (exit {proc.returncode})")
    return json.loads(lines[-1][len("RESULT "):])


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = set(families) - set(FAMILIES)
    if unknown:
        raise SystemExit(f"--families: unknown {', '.join(sorted(unknown))}; choose from {', '.join(FAMILIES)}")
    root = default_cache_dir() / "bench-families"
    rows = []
    for family in families:
        model = checkpoint(family, root)
        row = {"family": family, "architecture": json.loads((model / "config.json").read_text())["architectures"][0]}
        for workload, baseline, prompts, length in (("one", "hf-sequential", 1, args.one_len),
                                                    ("batch", "hf-static-batch", args.batch, args.batch_len)):
            print(f"== {family}: {workload} ({prompts} x {length})", file=sys.stderr, flush=True)
            hf = _worker(model, baseline, prompts, length, args)
            ours = _worker(model, "llmaccel", prompts, length, args)
            row[workload] = {"hf_tok_s": hf["output_tokens_per_s"], "llmaccel_tok_s": ours["output_tokens_per_s"],
                             "ratio": ours["output_tokens_per_s"] / hf["output_tokens_per_s"],
                             "dtype": ours.get("dtype")}
        rows.append(row)
    table = Table(title=f"every family at {SHAPE['layers']} layers x {SHAPE['hidden']} (random weights); "
                        f"1 x {args.one_len} and {args.batch} x {args.batch_len} tokens")
    for column in ("family", "HF 1 req tok/s", "llmaccel 1 req", "ratio", f"HF batch {args.batch}",
                   "llmaccel batch", "ratio", "llmaccel dtype"):
        table.add_column(column, justify="right")
    for r in rows:
        one, batch = r["one"], r["batch"]
        table.add_row(r["family"], f"{one['hf_tok_s']:.1f}", f"{one['llmaccel_tok_s']:.1f}", f"{one['ratio']:.2f}x",
                      f"{batch['hf_tok_s']:.1f}", f"{batch['llmaccel_tok_s']:.1f}", f"{batch['ratio']:.2f}x",
                      str(one["dtype"]))
    Console(width=140).print(table)
    if args.result_json:
        write_result(args.result_json, args, shape=SHAPE, families=rows)
    return 0
