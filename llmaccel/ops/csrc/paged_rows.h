// Walking the paged KV pool through block tables, for decode attention over float32/bfloat16 caches
// (paged_attention.cpp) and INT8 ones (kv_int8.cpp): one sequence's rows, an item's first rows requested
// ahead, and a step's (sequence, KV head) items over ATen's threads.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "kernels.h"

namespace llmaccel {

// Blocks lie anywhere in the pool and the hardware prefetcher stops at page edges, so while row j
// of a block is read, row j of the sequence's next block is requested (measured: ~20% faster).
inline void prefetch_bytes(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset, 0, 3);
}

// Calls visit(row, t - first) for the rows of tokens first..len-1 of one sequence, block by block,
// prefetching (`row_bytes` of) row j of the next block while row j of this one is visited.
template <typename scalar_t, typename Visit>
inline void for_each_row(const scalar_t* cache, const int32_t* table, int64_t first, int64_t len,
                         int64_t block_size, int64_t block_elems, int64_t row_stride, int64_t row_bytes,
                         Visit visit) {
  for (int64_t t0 = first - first % block_size; t0 < len; t0 += block_size) {
    const scalar_t* block = cache + table[t0 / block_size] * block_elems;
    const scalar_t* next = t0 + block_size < len ? cache + table[t0 / block_size + 1] * block_elems : nullptr;
    const int64_t n = std::min(block_size, len - t0);
    for (int64_t j = std::max<int64_t>(0, first - t0); j < n; ++j) {
      if (next) prefetch_bytes(next + j * row_stride, row_bytes);
      visit(block + j * row_stride, t0 + j - first);
    }
  }
}

// An item's keys and values (its first kPrefetchRows rows), requested into L2 while the item before
// it is attended: an item's own loop requests one block ahead, which left the first block a cold miss
// row by row and kept too few requests in flight to cover memory's latency (a 64-sequence step's
// attention read its KV at ~9 GB/s with blocks in no order; ~13 with this). `head_stride`: the elements
// of one KV head's row (head_dim; head_dim + 2 in an INT8 cache).
constexpr int64_t kPrefetchRows = 256;

template <typename T>
inline void prefetch_item_rows(const T* k_cache, const T* v_cache, const int32_t* table, int64_t context_len,
                               int64_t window, int64_t kvh, int64_t num_kv_heads, int64_t head_stride,
                               int64_t block_size) {
  const int64_t first = window > 0 ? std::max<int64_t>(0, context_len - window) : 0;
  const int64_t row_stride = num_kv_heads * head_stride, last = std::min(context_len, first + kPrefetchRows);
  const int64_t bytes = head_stride * static_cast<int64_t>(sizeof(T));
  for (int64_t t = first; t < last; ++t) {
    const int64_t offset = (table[t / block_size] * block_size + t % block_size) * row_stride + kvh * head_stride;
    for (int64_t o = 0; o < bytes; o += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(k_cache + offset) + o, 0, 2);
      __builtin_prefetch(reinterpret_cast<const char*>(v_cache + offset) + o, 0, 2);
    }
  }
}

// A decode step's work items over ATen's threads: one item is a (sequence, KV head) pair, so a lone
// sequence still spreads over the threads (one item a sequence left one core idle). Each thread calls
// prefetch(seq, kvh) for its next item, then attend(seq, kvh, scratch) for this one.
template <typename Prefetch, typename Attend>
inline void for_each_decode_item(int64_t num_seqs, int64_t num_kv_heads, Prefetch prefetch, Attend attend) {
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    AttentionScratch scratch;
    for (int64_t item = begin; item < end; ++item) {
      if (item + 1 < end) prefetch((item + 1) / num_kv_heads, (item + 1) % num_kv_heads);
      attend(item / num_kv_heads, item % num_kv_heads, scratch);
    }
  });
}

}  // namespace llmaccel
