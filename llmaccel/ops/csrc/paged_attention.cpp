// Paged attention for decode (one query token per sequence) on the CPU.
//
// Reads keys and values straight from the block-structured KV pool through each sequence's block
// table, so nothing is gathered or copied. One work item is a sequence; its blocks are read row by row
// (contiguous memory), each row once per pass for all heads. Threads come from ATen's own
// pool (at::parallel_for), so the kernel never competes with a second OpenMP runtime.
#include "aten.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "paged_rows.h"

using llmaccel::for_each_row;
using llmaccel::prefetch_bytes;

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LLMACCEL_ATTENTION_AVX2 1
#endif

// A query head against a key: four independent sums (the compiler's single chain waited on FMA
// latency: a fifth of the attention's time went to it, measured with perf).
static inline float dot(const float* a, const float* b, int64_t n) {
#ifdef LLMACCEL_ATTENTION_AVX2
  if (n % 32 == 0) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t i = 0; i < n; i += 32) {
      s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
      s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
      s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
      s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
    }
    return llmaccel::hsum8(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
  }
#endif
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// c10's conversions, but for float32 and bfloat16 in operations the compiler vectorises (one element
// at a time, converting an item's queries and outputs cost as much as its scores at 100 keys).
template <typename scalar_t>
static inline float as_float(scalar_t v) {
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>)
    return llmaccel::to_float(v);
  else
    return static_cast<float>(v);
}
template <typename scalar_t>
static inline scalar_t rounded_to(float v) {
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>)
    return llmaccel::round_to<scalar_t>(v);
  else
    return static_cast<scalar_t>(v);
}

// A cache row as float32: float rows as they are; bfloat16 widened by a shift (bf16 is the top half of
// a float32), a loop the compiler vectorises (c10's conversion one element at a time did not: bf16
// attention ran at a fifth of float32's speed); float16 through c10.
template <typename scalar_t>
static inline const float* as_floats(const scalar_t* row, int64_t n, float* buffer) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return row;
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const auto* bits = reinterpret_cast<const uint16_t*>(row);
    auto* out = reinterpret_cast<uint32_t*>(buffer);
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
    return buffer;
  } else {
    for (int64_t i = 0; i < n; ++i) buffer[i] = static_cast<float>(row[i]);
    return buffer;
  }
}

#if defined(__AVX512F__) && defined(LLMACCEL_ATTENTION_AVX2)
#define LLMACCEL_ATTENTION_AVX512 1
// 16 cache values as float32 (float32 or bf16 caches only).
template <typename scalar_t>
static inline __m512 load16(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>)
    return _mm512_loadu_ps(p);
  else
    return llmaccel::widen16(p);
}

static inline __m256 halves_sum(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}

// The weighted sum of the value rows for query heads h0 .. h0 + HC - 1 in one pass, each row widened
// once: HC x DV accumulators of 16 lanes stay in registers. Each lane sums in row order, as the
// one-head-at-a-time loop did, so the results are the same to the bit.
template <int DV, int HC, typename scalar_t>
static inline void weigh_values(const scalar_t* v_cache, const int32_t* table, int64_t first, int64_t context_len,
                                int64_t block_size, int64_t block_elems, int64_t row_stride, int64_t head_bytes,
                                const float* scores, int64_t len, int64_t h0, float* acc) {
  __m512 sum[HC][DV];
  for (int h = 0; h < HC; ++h)
    for (int d = 0; d < DV; ++d) sum[h][d] = _mm512_setzero_ps();
  for_each_row(v_cache, table, first, context_len, block_size, block_elems, row_stride, head_bytes,
               [&](const scalar_t* row, int64_t t) {
                 __m512 v[DV];
                 for (int d = 0; d < DV; ++d) v[d] = load16(row + 16 * d);
                 for (int h = 0; h < HC; ++h) {
                   const __m512 w = _mm512_set1_ps(scores[(h0 + h) * len + t]);
                   for (int d = 0; d < DV; ++d) sum[h][d] = _mm512_fmadd_ps(w, v[d], sum[h][d]);
                 }
               });
  for (int h = 0; h < HC; ++h)
    for (int d = 0; d < DV; ++d) _mm512_storeu_ps(acc + (h0 + h) * DV * 16 + 16 * d, sum[h][d]);
}

// Every query head of the group against a key row widened once into registers. Each dot keeps the
// portable dot()'s four chains: chain c sums elements 8c .. 8c + 7 of every 32, so two 16-lane chains
// hold (0, 1) and (2, 3), and the halves are added as dot() adds them.
template <int DV, typename scalar_t>
static inline void score_keys(const scalar_t* k_cache, const int32_t* table, int64_t first, int64_t context_len,
                              int64_t block_size, int64_t block_elems, int64_t row_stride, int64_t head_bytes,
                              const float* qf, int64_t group, int64_t len, float* scores) {
  for_each_row(k_cache, table, first, context_len, block_size, block_elems, row_stride, head_bytes,
               [&](const scalar_t* row, int64_t t) {
                 __m512 key[DV];
                 for (int d = 0; d < DV; ++d) key[d] = load16(row + 16 * d);
                 for (int64_t h = 0; h < group; ++h) {
                   const float* q = qf + h * DV * 16;
                   __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), key[0]);
                   __m512 b = _mm512_mul_ps(_mm512_loadu_ps(q + 16), key[1]);
                   for (int d = 2; d < DV; d += 2) {
                     a = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * d), key[d], a);
                     b = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * d + 16), key[d + 1], b);
                   }
                   scores[h * len + t] = llmaccel::hsum8(_mm256_add_ps(halves_sum(a), halves_sum(b)));
                 }
               });
}
#endif

#if defined(LLMACCEL_ATTENTION_AVX512) && defined(__AVX512BF16__)
#define LLMACCEL_ATTENTION_BF16_DOT 1
// The 16 lane sums of p[0..15], in order: 16 horizontal sums in 45 instructions (one at a time took ~10
// each, and with the widening of every key they were most of a bf16 decode step's attention).
static inline __m512 lane_sums16(const __m512* p) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // 128-bit lane L of pairs[i]: keys 2i, 2i+1, two partial sums each
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i], p[2 * i + 1]), _mm512_unpackhi_ps(p[2 * i], p[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // lane L of quads[i]: keys 4i .. 4i + 3, lane L's share of each
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 h01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 h23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(h01, h23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(h01, h23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// bfloat16 scores straight from the cache: a query head and a key row meet in vdpbf16ps (DV = head_dim
// / 32 instructions, no widening), sixteen rows of a block at a time summed by lane_sums16, each score
// scaled after its sum.
template <int DV>
static void score_keys_bf16(const c10::BFloat16* k_cache, const int32_t* table, int64_t first, int64_t context_len,
                            int64_t block_size, int64_t block_elems, int64_t row_stride, int64_t head_bytes,
                            const c10::BFloat16* q_group, int64_t group, float scale, int64_t len, float* scores) {
  auto key = [](const c10::BFloat16* row, int c) {
    return (__m512bh)_mm512_loadu_si512(row + 32 * c);
  };
  for (int64_t t0 = first - first % block_size; t0 < context_len; t0 += block_size) {
    const c10::BFloat16* block = k_cache + table[t0 / block_size] * block_elems;
    // row i of the next block is requested as row i of this one is first read (as for_each_row does)
    const c10::BFloat16* next = t0 + block_size < context_len ? k_cache + table[t0 / block_size + 1] * block_elems
                                                              : nullptr;
    const int64_t n = std::min(block_size, context_len - t0);
    int64_t j = std::max<int64_t>(0, first - t0);
    for (int64_t h = 0; h < group; ++h) {
      __m512bh q[DV];
      for (int c = 0; c < DV; ++c) q[c] = (__m512bh)_mm512_loadu_si512(q_group + h * DV * 32 + 32 * c);
      float* out = scores + h * len + (t0 - first);
      int64_t i = j;
      for (; i + 16 <= n; i += 16) {
        __m512 p[16];
        for (int r = 0; r < 16; ++r) {
          const c10::BFloat16* row = block + (i + r) * row_stride;
          if (h == 0 && next) prefetch_bytes(next + (i + r) * row_stride, head_bytes);
          p[r] = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], key(row, 0));
          for (int c = 1; c < DV; ++c) p[r] = _mm512_dpbf16_ps(p[r], q[c], key(row, c));
        }
        _mm512_storeu_ps(out + i, _mm512_mul_ps(lane_sums16(p), _mm512_set1_ps(scale)));
      }
      for (; i < n; ++i) {
        const c10::BFloat16* row = block + i * row_stride;
        if (h == 0 && next) prefetch_bytes(next + i * row_stride, head_bytes);
        __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], key(row, 0));
        for (int c = 1; c < DV; ++c) acc = _mm512_dpbf16_ps(acc, q[c], key(row, c));
        out[i] = _mm512_reduce_add_ps(acc) * scale;
      }
    }
  }
}
#endif

#ifdef LLMACCEL_ATTENTION_AVX512
// Pass 1 at head_dim 64 or 128 (DV = head_dim / 16): bf16 caches through vdpbf16ps where the CPU has
// it, else each key widened once into registers against the scaled queries qf.
template <int DV, typename scalar_t>
static void score_wide(const scalar_t* k_head, const int32_t* table, int64_t first, int64_t context_len,
                       int64_t block_size, int64_t block_elems, int64_t row_stride, int64_t head_bytes,
                       const scalar_t* q_group, const float* qf, int64_t group, float scale, int64_t len,
                       float* scores) {
#ifdef LLMACCEL_ATTENTION_BF16_DOT
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>)
    return score_keys_bf16<DV / 2>(k_head, table, first, context_len, block_size, block_elems, row_stride,
                                   head_bytes, q_group, group, scale, len, scores);
#endif
  score_keys<DV>(k_head, table, first, context_len, block_size, block_elems, row_stride, head_bytes, qf, group, len,
                 scores);
}

// Pass 2 at head_dim 64 or 128: the group's heads in passes of up to 16-24 accumulators (four heads a
// pass at head_dim 64, two at 128, then the rest).
template <int DV, typename scalar_t>
static void weigh_wide(const scalar_t* v_head, const int32_t* table, int64_t first, int64_t context_len,
                       int64_t block_size, int64_t block_elems, int64_t row_stride, int64_t head_bytes,
                       const float* scores, int64_t len, int64_t group, float* acc) {
  for (int64_t h0 = 0; h0 < group;) {
    const int64_t left = group - h0;
    if constexpr (DV == 4) {
      if (left >= 4) {
        weigh_values<DV, 4>(v_head, table, first, context_len, block_size, block_elems, row_stride, head_bytes,
                            scores, len, h0, acc);
        h0 += 4;
        continue;
      }
      if (left == 3) {
        weigh_values<DV, 3>(v_head, table, first, context_len, block_size, block_elems, row_stride, head_bytes,
                            scores, len, h0, acc);
        h0 += 3;
        continue;
      }
    }
    if (left >= 2) {
      weigh_values<DV, 2>(v_head, table, first, context_len, block_size, block_elems, row_stride, head_bytes,
                          scores, len, h0, acc);
      h0 += 2;
    } else {
      weigh_values<DV, 1>(v_head, table, first, context_len, block_size, block_elems, row_stride, head_bytes,
                          scores, len, h0, acc);
      h0 += 1;
    }
  }
}
#endif

// One (sequence, KV head) item: its `group` query heads share every key and value they read. Pass 1
// scores every key for the group's heads, reading the blocks' rows in order; then softmax per head;
// pass 2 sums the weighted values the same way. Separate branch-free loops let the compiler vectorise
// each one.
template <typename scalar_t>
static LLMACCEL_ONE_COPY void attend(const scalar_t* q_group, const scalar_t* k_cache, const scalar_t* v_cache, const int32_t* table,
                   int64_t context_len, int64_t window, int64_t kvh, int64_t group, int64_t num_kv_heads,
                   int64_t head_dim, int64_t block_size, float scale, float softcap, scalar_t* out_group,
                   llmaccel::AttentionScratch& scratch) {
  const int64_t row_stride = num_kv_heads * head_dim;  // one token's K (or V) row, all kv heads
  const int64_t head_bytes = head_dim * static_cast<int64_t>(sizeof(scalar_t));
  const int64_t block_elems = block_size * row_stride;
  const int64_t first = window > 0 ? std::max<int64_t>(0, context_len - window) : 0;
  const int64_t len = context_len - first;  // keys this query sees: the last `window` ones, or all
  scratch.qf.resize(group * head_dim);
  scratch.acc.assign(group * head_dim, 0.0f);
  scratch.inv_sum.resize(group);
  if (static_cast<int64_t>(scratch.scores.size()) < group * len) scratch.scores.resize(group * len);
  scratch.widened.resize(head_dim);
  float *qf = scratch.qf.data(), *acc = scratch.acc.data(), *scores = scratch.scores.data();
  float* widened = scratch.widened.data();
  // float32 and bf16 caches at head_dim 64 or 128 take the AVX-512 passes; float16 and double the
  // portable ones
#ifdef LLMACCEL_ATTENTION_AVX512
  constexpr bool widens = std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>;
  const bool wide = widens && (head_dim == 64 || head_dim == 128);
#else
  const bool wide = false;
#endif
#ifdef LLMACCEL_ATTENTION_BF16_DOT
  const bool dots_bf16 = wide && std::is_same_v<scalar_t, c10::BFloat16>;  // the queries as they are
#else
  const bool dots_bf16 = false;
#endif
  if (!dots_bf16)
    for (int64_t i = 0; i < group * head_dim; ++i) qf[i] = as_float(q_group[i]) * scale;
  if (wide) {
#ifdef LLMACCEL_ATTENTION_AVX512
    if constexpr (widens) {
      if (head_dim == 64)
        score_wide<4>(k_cache + kvh * head_dim, table, first, context_len, block_size, block_elems, row_stride,
                      head_bytes, q_group, qf, group, scale, len, scores);
      else
        score_wide<8>(k_cache + kvh * head_dim, table, first, context_len, block_size, block_elems, row_stride,
                      head_bytes, q_group, qf, group, scale, len, scores);
    }
#endif
  } else {
    for_each_row(k_cache + kvh * head_dim, table, first, context_len, block_size, block_elems, row_stride,
                 head_bytes, [&](const scalar_t* row, int64_t t) {
                   const float* key = as_floats(row, head_dim, widened);
                   for (int64_t h = 0; h < group; ++h) scores[h * len + t] = dot(qf + h * head_dim, key, head_dim);
                 });
  }
  if (softcap > 0.0f) llmaccel::softcap_inplace(scores, group * len, softcap);
  for (int64_t h = 0; h < group; ++h) scratch.inv_sum[h] = llmaccel::softmax_inplace(scores + h * len, len);
  if (wide) {
#ifdef LLMACCEL_ATTENTION_AVX512
    if constexpr (widens) {
      if (head_dim == 64)
        weigh_wide<4>(v_cache + kvh * head_dim, table, first, context_len, block_size, block_elems, row_stride,
                      head_bytes, scores, len, group, acc);
      else
        weigh_wide<8>(v_cache + kvh * head_dim, table, first, context_len, block_size, block_elems, row_stride,
                      head_bytes, scores, len, group, acc);
    }
#endif
  } else
#ifdef LLMACCEL_ATTENTION_AVX2
  if (head_dim % 64 == 0) {
    // A head's 64-wide slice of its output sits in eight registers while every value row passes (the
    // rows stay in L1 between heads); updating it in memory row by row chained stores to loads.
    for (int64_t h = 0; h < group; ++h) {
      for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        const float* w = scores + h * len;
        for_each_row(v_cache + kvh * head_dim + d0, table, first, context_len, block_size, block_elems, row_stride,
                     head_bytes, [&](const scalar_t* v_row, int64_t t) {
                       const float* v = as_floats(v_row, 64, widened);
                       const __m256 wt = _mm256_set1_ps(w[t]);
                       a0 = _mm256_fmadd_ps(wt, _mm256_loadu_ps(v), a0);
                       a1 = _mm256_fmadd_ps(wt, _mm256_loadu_ps(v + 8), a1);
                       a2 = _mm256_fmadd_ps(wt, _mm256_loadu_ps(v + 16), a2);
                       a3 = _mm256_fmadd_ps(wt, _mm256_loadu_ps(v + 24), a3);
                       a4 = _mm256_fmadd_ps(wt, _mm256_loadu_ps(v + 32), a4);
                       a5 = _mm256_fmadd_ps(wt, _mm256_loadu_ps(v + 40), a5);
                       a6 = _mm256_fmadd_ps(wt, _mm256_loadu_ps(v + 48), a6);
                       a7 = _mm256_fmadd_ps(wt, _mm256_loadu_ps(v + 56), a7);
                     });
        float* out = acc + h * head_dim + d0;
        _mm256_storeu_ps(out, a0), _mm256_storeu_ps(out + 8, a1), _mm256_storeu_ps(out + 16, a2);
        _mm256_storeu_ps(out + 24, a3), _mm256_storeu_ps(out + 32, a4), _mm256_storeu_ps(out + 40, a5);
        _mm256_storeu_ps(out + 48, a6), _mm256_storeu_ps(out + 56, a7);
      }
    }
  } else
#endif
  for_each_row(v_cache + kvh * head_dim, table, first, context_len, block_size, block_elems, row_stride, head_bytes,
               [&](const scalar_t* v_row, int64_t t) {
                 const float* value = as_floats(v_row, head_dim, widened);
                 for (int64_t h = 0; h < group; ++h) {
                   const float w = scores[h * len + t];
                   float* acc_h = acc + h * head_dim;
                   for (int64_t d = 0; d < head_dim; ++d) acc_h[d] += w * value[d];
                 }
               });
  for (int64_t h = 0; h < group; ++h)
    for (int64_t d = 0; d < head_dim; ++d)
      out_group[h * head_dim + d] = rounded_to<scalar_t>(acc[h * head_dim + d] * scratch.inv_sum[h]);
}

void llmaccel::prefetch_item(const float* k_cache, const float* v_cache, const int32_t* table, int64_t len,
                             int64_t window, int64_t kv_head, int64_t num_kv_heads, int64_t head_dim,
                             int64_t block_size) {
  llmaccel::prefetch_item_rows(k_cache, v_cache, table, len, window, kv_head, num_kv_heads, head_dim, block_size);
}

void llmaccel::prefetch_item(const bf16* k_cache, const bf16* v_cache, const int32_t* table, int64_t len,
                             int64_t window, int64_t kv_head, int64_t num_kv_heads, int64_t head_dim,
                             int64_t block_size) {
  llmaccel::prefetch_item_rows(k_cache, v_cache, table, len, window, kv_head, num_kv_heads, head_dim, block_size);
}

void llmaccel::attend_item(const float* q, const float* k_cache, const float* v_cache, const int32_t* table,
                           int64_t len, int64_t window, int64_t kv_head, int64_t group, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, float scale, float softcap, float* out,
                           AttentionScratch& scratch) {
  attend(q, k_cache, v_cache, table, len, window, kv_head, group, num_kv_heads, head_dim, block_size, scale, softcap,
         out, scratch);
}

void llmaccel::attend_item(const bf16* q, const bf16* k_cache, const bf16* v_cache, const int32_t* table,
                           int64_t len, int64_t window, int64_t kv_head, int64_t group, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, float scale, float softcap, bf16* out,
                           AttentionScratch& scratch) {
  attend(q, k_cache, v_cache, table, len, window, kv_head, group, num_kv_heads, head_dim, block_size, scale, softcap,
         out, scratch);
}

template <typename scalar_t>
static void decode_kernel(const scalar_t* q, int64_t q_stride, const scalar_t* k_cache, const scalar_t* v_cache,
                          const int32_t* block_tables, const int32_t* context_lens, scalar_t* out,
                          int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t block_size, int64_t max_blocks, int64_t window, float scale, float softcap) {
  const int64_t group = num_heads / num_kv_heads;
  llmaccel::for_each_decode_item(
      num_seqs, num_kv_heads,
      [&](int64_t seq, int64_t kvh) {
        llmaccel::prefetch_item_rows(k_cache, v_cache, block_tables + seq * max_blocks, context_lens[seq], window,
                                     kvh, num_kv_heads, head_dim, block_size);
      },
      [&](int64_t seq, int64_t kvh, llmaccel::AttentionScratch& scratch) {
        attend(q + seq * q_stride + kvh * group * head_dim, k_cache, v_cache, block_tables + seq * max_blocks,
               context_lens[seq], window, kvh, group, num_kv_heads, head_dim, block_size, scale, softcap,
               out + (seq * num_heads + kvh * group) * head_dim, scratch);
      });
}

torch::Tensor paged_decode_attention_int8(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                          torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size,
                                          int64_t window, double scale, double softcap);
void write_kv_int8(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor slots);

// q: [S, H, D] (rows may be strided: a view of the fused qkv projection); k_cache, v_cache: [num_slots,
// KVH, D] with slot = block * block_size + offset (int8 caches: [num_slots, KVH, D + 2], kv_int8.cpp);
// block_tables: [S, max_blocks] int32; context_lens: [S] int32 (keys in each table). With window > 0 (a
// sliding-window layer) each query sees only the last `window` of its keys. With softcap > 0 the scores are
// capped, softcap * tanh(s / softcap), before the softmax (Gemma 2). Returns [S, H, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     int64_t block_size, int64_t window, double scale, double softcap) {
  if (k_cache.scalar_type() == torch::kInt8)
    return paged_decode_attention_int8(q, k_cache, v_cache, block_tables, context_lens, block_size, window, scale,
                                       softcap);
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q and caches must be 3-D");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "each query row must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && context_lens.scalar_type() == torch::kInt32,
              "block_tables and context_lens must be int32");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = torch::empty(q.sizes(), q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), k_cache.data_ptr<scalar_t>(),
                            v_cache.data_ptr<scalar_t>(), tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(),
                            out.data_ptr<scalar_t>(), q.size(0), q.size(1), k_cache.size(1), q.size(2), block_size,
                            tables.size(1), window, static_cast<float>(scale), static_cast<float>(softcap));
  });
  return out;
}

// k_cache[slots[t]] = k[t] and v_cache[slots[t]] = v[t] for every new token t (k, v: [T, KVH, D], rows
// may be strided views of the fused qkv projection): the two index_copy_ calls of the torch path in one.
// An int8 cache quantizes each row as it is written (kv_int8.cpp).
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slots) {
  if (k_cache.scalar_type() == torch::kInt8) return write_kv_int8(k, v, k_cache, v_cache, slots);
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes(), "k and v must be [T, KVH, D] alike");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "each key and value row must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(1) * k_cache.size(2) ==
              k.size(1) * k.size(2), "caches must be contiguous [num_slots, KVH, D]");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(),
              "new keys and values must have the cache's dtype");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous() && slots.numel() == k.size(0),
              "slots must be contiguous int64 [T]");
  const int64_t tokens = k.size(0), num_slots = k_cache.size(0);
  const int64_t row_bytes = k.size(1) * k.size(2) * k.element_size();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const auto* k_src = static_cast<const char*>(k.data_ptr());
  const auto* v_src = static_cast<const char*>(v.data_ptr());
  auto* k_dst = static_cast<char*>(k_cache.data_ptr());
  auto* v_dst = static_cast<char*>(v_cache.data_ptr());
  for (int64_t t = 0; t < tokens; ++t)  // all checked before any is written
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot ", slot[t], " is outside the KV pool of ", num_slots);
  for (int64_t t = 0; t < tokens; ++t) {
    std::memcpy(k_dst + slot[t] * row_bytes, k_src + t * k.stride(0) * k.element_size(), row_bytes);
    std::memcpy(v_dst + slot[t] * row_bytes, v_src + t * v.stride(0) * v.element_size(), row_bytes);
  }
}

void rope_(torch::Tensor qk, int64_t heads, int64_t head_dim, torch::Tensor positions, torch::Tensor cos,
           torch::Tensor sin);

// A decode-only step's attention in one call (every token is one sequence's next): rotates q and k of
// the fused projection qkv [S, (H + 2 KVH) * D] in place, writes k and v at `slots`, and attends.
// Returns [S, H * D]. From Python these were ~15 tensor views and calls a layer at 4-10 us each.
torch::Tensor fused_decode_attention(torch::Tensor qkv, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                     torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                                     torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                                     torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size,
                                     int64_t window, double scale, double softcap) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim,
              "qkv must be contiguous [S, (H + 2 KVH) * D]");
  const int64_t seqs = qkv.size(0);
  rope_(qkv, num_heads + num_kv_heads, head_dim, positions, cos, sin);
  auto heads = qkv.view({seqs, num_heads + 2 * num_kv_heads, head_dim});
  auto q = heads.narrow(1, 0, num_heads);
  write_kv(heads.narrow(1, num_heads, num_kv_heads), heads.narrow(1, num_heads + num_kv_heads, num_kv_heads),
           k_cache, v_cache, slots);
  return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, block_size, window, scale, softcap)
      .view({seqs, num_heads * head_dim});
}
