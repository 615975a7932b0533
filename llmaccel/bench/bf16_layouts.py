"""`llmaccel bench bf16-layouts`: the plain and the compact bf16 layouts' kernels on one layer's projections of a
published shape (random weights), from memory, at a few row counts: milliseconds, the bytes read a second, and
the compact layout's speed over the plain one's, in rounds that alternate the two.

A decode step reads each weight once from memory, so every projection is held in enough copies to pass the
last-level cache (--bytes), and each timing is one pass over all copies. The kernels are the ones the tuner
chooses between (ops/kernel_choice.py): stream and gemm on the plain layout, compact_stream and compact_gemm on
the compact one (csrc/bf16_compact.cpp), which give the same sums to the bit.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from llmaccel.bench.make_model import STD
from llmaccel.model.shapes import SHAPES, ModelShape, shape_named
from llmaccel.ops.kernel_choice import compact_available, pack_compact, run_bf16
from llmaccel.platform import cpu_model

PAIRS = (("stream", "compact_stream"), ("gemm", "compact_gemm"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES),
                        help="the published model whose layer shapes to time (model/shapes.py)")
    parser.add_argument("--rows", default="1,4,16,64", help="comma-separated row counts (activation rows)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds; medians are reported")
    parser.add_argument("--bytes", type=float, default=600e6,
                        help="bf16 bytes of copies per projection, past any last-level cache")
    parser.add_argument("--result-json", type=Path, default=None, help="also write the figures here")


def projections(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """One layer's projections as the engine fuses them: name -> (outputs, inputs)."""
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    return {"qkv": (q + 2 * kv, shape.hidden_size), "o": (shape.hidden_size, q),
            "gate_up": (2 * shape.intermediate_size, shape.hidden_size),
            "down": (shape.hidden_size, shape.intermediate_size)}


def _pass_ms(kernel: str, x: torch.Tensor, weights: list[torch.Tensor], n: int) -> float:
    start = time.perf_counter()
    for w in weights:
        run_bf16(kernel, x, w, n)
    return (time.perf_counter() - start) / len(weights) * 1e3


def measure(shape: ModelShape, rows: list[int], rounds: int, budget: float) -> list[dict]:
    results = []
    generator = torch.Generator().manual_seed(0)
    for name, (n, k) in tqdm(projections(shape).items(), desc="projections"):
        copies = max(2, int(budget // (n * k * 2)))
        plain = [(torch.randn(n, k, generator=generator) * STD).to(torch.bfloat16) for _ in range(copies)]
        compact = [pack_compact(w) for w in plain]
        if any(c is None for c in compact):
            raise ValueError(f"{name} [{n} x {k}] does not fit the compact layout (K must be a multiple of 64)")
        compact_bytes = sum(c.numel() for c in compact) / copies
        for m in rows:
            x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
            for plain_kernel, compact_kernel in PAIRS:
                times: dict[str, list[float]] = {plain_kernel: [], compact_kernel: []}
                for _ in range(rounds):
                    times[plain_kernel].append(_pass_ms(plain_kernel, x, plain, n))
                    times[compact_kernel].append(_pass_ms(compact_kernel, x, compact, n))
                p, c = statistics.median(times[plain_kernel]), statistics.median(times[compact_kernel])
                results.append({"projection": name, "n": n, "k": k, "rows": m, "plain_kernel": plain_kernel,
                                "plain_ms": round(p, 3), "plain_gbs": round(n * k * 2 / p / 1e6, 1),
                                "compact_ms": round(c, 3), "compact_gbs": round(compact_bytes / c / 1e6, 1),
                                "compact_bytes_share": round(compact_bytes / (n * k * 2), 4),
                                "speedup": round(p / c, 3)})
        del plain, compact
    return results


def run(args: argparse.Namespace) -> int:
    if not compact_available():
        raise SystemExit("the compact bf16 kernels need AVX512-BF16 (this CPU or build has none)")
    rows = [int(r) for r in args.rows.split(",")]
    shape = shape_named(args.shape)
    results = measure(shape, rows, args.rounds, args.bytes)
    print(f"{shape.name}, random weights; {cpu_model()}, {torch.get_num_threads()} threads; medians of "
          f"{args.rounds} alternating rounds, each a pass over copies past the cache")
    print("| projection [N x K] | rows | plain kernel | plain ms (GB/s) | compact ms (GB/s) | compact over plain |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['projection']} [{r['n']} x {r['k']}] | {r['rows']} | {r['plain_kernel']} | "
              f"{r['plain_ms']} ({r['plain_gbs']}) | {r['compact_ms']} ({r['compact_gbs']}) | {r['speedup']}x |")
    if args.result_json:
        record = {"shape": shape.name, "weights": "random", "machine": cpu_model(), "python": platform.python_version(),
                  "torch": torch.__version__, "threads": torch.get_num_threads(), "rounds": args.rounds,
                  "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "results": results}
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(record, indent=1))
    return 0
