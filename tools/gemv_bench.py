"""One linear layer at a few row counts: oneDNN packed float32, llmaccel's float32 panel kernel, oneDNN's
bfloat16 GEMM (F.linear), llmaccel's bfloat16 streaming kernel and AVX512-BF16 GEMM, torch's INT8 kernel and llmaccel's
INT8/INT4 kernels (ops/gemv.py), with the read rate each reaches.
The figures in docs/results/issue14/HISTORY.md ("Fast on the machine it lands on") and ops/cpu_linear.py came from
this comparison.

    .venv/bin/python tools/gemv_bench.py --rows 1,8,64,256,1024
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from llmaccel.ops.cpu_linear import pack_weight, packed_linear
from llmaccel.ops.gemv import gemv_kernels, pack_int4_blocks, pack_int8_blocks, to_panels
from llmaccel.platform import describe, read_bandwidth_gbps

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def best_seconds(fn, calls: int, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best / calls


def copies(weight_bytes: float) -> int:
    """Distinct copies of a weight that fill 64 MiB, so none stays in the (32 MB) L3 between calls."""
    return max(1, int(64 * 2**20 // weight_bytes))


def layer_timings(kernels, x, panels, packed, bf16, q8, b8, scale_bf16, q4) -> dict[str, tuple[float, float]]:
    """Seconds a call and bytes a weight for each kernel on rows x (each over its own list of copies)."""
    n = panels[0].shape[0] * 16
    floats, int8s, int4s = len(panels), len(b8), len(q4)
    return {
        "onednn-f32": (best_seconds(lambda: [packed_linear(x, p, None) for p in packed], floats), 4),
        "panel-f32": (best_seconds(lambda: [kernels.linear_f32(x, p, n) for p in panels], floats), 4),
        "onednn-bf16": (best_seconds(lambda: [F.linear(x.bfloat16(), w) for w in bf16], len(bf16)), 2),
        "stream-bf16": (best_seconds(lambda: [kernels.gemv_bf16(x, w) for w in bf16], len(bf16)), 2),
        **({"gemm-bf16": (best_seconds(lambda: [kernels.gemm_bf16(x.bfloat16(), w) for w in bf16], len(bf16)), 2)}
           if kernels.gemm_bf16_available() else {}),
        "torch-int8": (best_seconds(lambda: [torch._weight_int8pack_mm(x.bfloat16(), q, scale_bf16) for q in q8],
                                    len(q8)), 1),
        "gemv-int8": (best_seconds(lambda: [kernels.gemv_i8(x, *p, n) for p in b8], int8s), 1),
        "gemv-int4": (best_seconds(lambda: [kernels.gemv_i4(x, q, n) for q in q4], int4s), 0.625),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,64", help="comma list of row counts (batch sizes)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = gemv_kernels()
    if kernels is None:
        raise SystemExit("llmaccel's weight-streaming kernels are unavailable here (see the log)")
    print(describe(), f"read bandwidth {read_bandwidth_gbps():.1f} GB/s")
    for name, (n, k) in SHAPES.items():
        dense = [torch.randn(n, k) for _ in range(copies(n * k * 4))]
        packed = [pack_weight(w) for w in dense]
        panels = [to_panels(w) for w in dense]
        bf16 = [torch.randn(n, k).bfloat16() for _ in range(copies(n * k * 2))]
        del dense
        q8 = [torch.randint(-127, 128, (n, k), dtype=torch.int8) for _ in range(copies(n * k))]
        scale, scale_bf16 = torch.rand(n), torch.rand(n).bfloat16()
        b8 = [pack_int8_blocks(q, scale) for q in q8]
        s4 = torch.rand(n, k // 32)
        q4 = [pack_int4_blocks(torch.randint(0, 16, (n, k)), s4, s4) for _ in range(copies(n * k * 0.625))]
        for rows in (int(r) for r in args.rows.split(",")):
            timings = layer_timings(kernels, torch.randn(rows, k), panels, packed, bf16, q8, b8, scale_bf16, q4)
            cells = [f"{kernel} {sec * 1e6:.0f} us ({n * k * size / sec / 1e9:.1f} GB/s)"
                     for kernel, (sec, size) in timings.items()]
            print(f"{name} {n}x{k} rows {rows}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
