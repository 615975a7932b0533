"""How fast the KV of a 64-sequence decode step can be read, by access pattern, against the paged
attention kernel itself: is the attention at its memory floor?

    .venv/bin/python tools/kv_read_pattern.py --rounds 3

Every layer's keys and values are distinct memory (30 layers, 64 sequences x --context keys, bf16, the
default model's 3 KV heads of 64), so each read comes from memory as it does in a step. Read-only loops
(compiled here with torch's inline extension builder) walk the blocks as the kernel would:
  per-head   an item is one (sequence, KV head): 128 bytes of every 384-byte token row, with the next
             item's rows requested before the item starts (the kernel's pattern);
  whole-row  an item is one sequence: every token row read whole, all KV heads.
Blocks lie in decode order (block j of every sequence, then block j + 1: how a batch that grows
together allocates) or in random order. A plain sum over the same bytes is the contiguous floor.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.cpp_extension import load_inline

from llmaccel.ops.cpu_kernels import load_cpu_kernels

LAYERS, KV_HEADS, HEAD_DIM, QUERY_HEADS = 30, 3, 64, 9

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

// Reads every key (or value) row of `caches` [blocks * block_rows, KVH, 64] bf16 through `tables`
// [S, blocks a sequence] int32; whole_rows: one item a sequence, else one a (sequence, KV head).
double read_kv(std::vector<torch::Tensor> caches, torch::Tensor tables, int64_t len, int64_t kv_heads,
               int64_t block_rows, bool whole_rows) {
  const int64_t row = kv_heads * 128, seqs = tables.size(0), per_seq = tables.size(1), block = block_rows * row;
  const int32_t* table = tables.data_ptr<int32_t>();
  double total = 0;
  for (auto& cache : caches) {
    const char* base = static_cast<const char*>(cache.data_ptr());
    const int64_t items = whole_rows ? seqs : seqs * kv_heads;
    std::vector<float> sums(items);
    at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t seq = whole_rows ? item : item / kv_heads, head = whole_rows ? 0 : item % kv_heads;
        const int64_t bytes = whole_rows ? row : 128;
        if (!whole_rows && item + 1 < end) {  // the kernel requests the next item's rows up front
          const int64_t next = (item + 1) / kv_heads, next_head = (item + 1) % kv_heads;
          for (int64_t t = 0; t < len; ++t) {
            const char* p = base + table[next * per_seq + t / block_rows] * block + (t % block_rows) * row;
            _mm_prefetch(p + next_head * 128, _MM_HINT_T1);
            _mm_prefetch(p + next_head * 128 + 64, _MM_HINT_T1);
          }
        }
        __m512 acc = _mm512_setzero_ps();
        for (int64_t t = 0; t < len; ++t) {
          const char* p = base + table[seq * per_seq + t / block_rows] * block + (t % block_rows) * row + head * 128;
          for (int64_t o = 0; o < bytes; o += 64)
            acc = _mm512_add_ps(acc, _mm512_loadu_ps(reinterpret_cast<const float*>(p + o)));
        }
        sums[item] = _mm512_reduce_add_ps(acc);
      }
    });
    for (float s : sums) total += s;
  }
  return total;
}
"""


def best_ms(fn, repeats: int = 7) -> float:
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - began)
    return best * 1e3


def block_tables(seqs: int, per_seq: int, order: str) -> torch.Tensor:
    ids = torch.randperm(seqs * per_seq) if order == "random" else torch.arange(seqs * per_seq)
    tables = ids.view(seqs, per_seq) if order == "random" else ids.view(per_seq, seqs).t()
    return tables.to(torch.int32).contiguous()


def one_size(probe, kernels, seqs: int, context: int, block_rows: int) -> list[str]:
    """The readings (ms a step) for blocks of `block_rows` rows, in both orders."""
    per_seq = -(-context // block_rows)
    slots = seqs * per_seq * block_rows
    keys = [torch.randn(slots, KV_HEADS, HEAD_DIM).bfloat16() for _ in range(LAYERS)]
    values = [torch.randn(slots, KV_HEADS, HEAD_DIM).bfloat16() for _ in range(LAYERS)]
    caches = keys + values
    query = torch.randn(seqs, QUERY_HEADS, HEAD_DIM).bfloat16()
    lens = torch.full((seqs,), context, dtype=torch.int32)
    cells = [f"blocks of {block_rows}"]
    for order in ("decode", "random"):
        tables = block_tables(seqs, per_seq, order)
        for whole in (False, True):
            ms = best_ms(lambda: probe.read_kv(caches, tables, context, KV_HEADS, block_rows, whole))  # noqa: B023
            cells.append(f"{order} {'whole-row' if whole else 'per-head'} {ms:.1f}")
        if kernels is not None and block_rows == 16:
            ms = best_ms(lambda: [kernels.paged_decode_attention(query, k, v, tables, lens, block_rows, 0, 0.125)  # noqa: B023
                                  for k, v in zip(keys, values, strict=True)])
            cells.append(f"{order} attention kernel {ms:.1f}")
    cells.append(f"plain sum {best_ms(lambda: [c.sum() for c in caches]):.1f}")
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=64, help="sequences in the step")
    parser.add_argument("--context", type=int, default=160, help="keys a sequence")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every reading")
    args = parser.parse_args()
    kernels = load_cpu_kernels()
    probe = load_inline("llmaccel_kv_read_pattern", cpp_sources=_SOURCE, functions=["read_kv"],
                        extra_cflags=["-O3", "-march=native"])
    for _ in range(args.rounds):
        for block_rows in (16, 64):
            print(" | ".join(one_size(probe, kernels, args.seqs, args.context, block_rows)) + "  (ms a step)",
                  flush=True)


if __name__ == "__main__":
    main()
