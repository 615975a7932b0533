// The INT8 KV cache (--kv-cache-dtype int8). Each token's key (or value) row of one KV head is head_dim
// int8 values followed by their float16 scale, head_dim + 2 bytes: x ~ q * scale with scale = max|x| / 127
// rounded to float16, one per token and head (as llama.cpp's q8_0 keeps a float16 scale per 32 values;
// per head row here, so the pool holds 1.94x bfloat16's tokens at head_dim 64, 1.97x at 128). Rows are
// quantized as they are written; decode attention reads them straight from the pool, widened in
// registers, with no dequantized copy. llmaccel/ops/kv_int8.py is the torch reference (same bytes).
#include "aten.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "paged_rows.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define LLMACCEL_KV_INT8_AVX512 1
#endif

namespace {

constexpr int64_t kScaleBytes = 2;
constexpr float kInverse127 = 1.0f / 127.0f;

inline float row_scale(const int8_t* row, int64_t head_dim) {
  return llmaccel::half_bits_to_float(reinterpret_cast<const uint8_t*>(row + head_dim));
}

// One head's row of head_dim values -> head_dim int8 and the float16 scale after them.
template <typename T>
void quantize_row(const T* x, int64_t head_dim, int8_t* out) {
  float amax = 0.0f;
  for (int64_t d = 0; d < head_dim; ++d) amax = std::max(amax, std::fabs(llmaccel::to_float(x[d])));
  const c10::Half half(amax * kInverse127);
  const float scale = static_cast<float>(half);
  const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
  for (int64_t d = 0; d < head_dim; ++d)
    out[d] = static_cast<int8_t>(std::clamp(std::nearbyint(llmaccel::to_float(x[d]) * inverse), -127.0f, 127.0f));
  std::memcpy(out + head_dim, &half.x, kScaleBytes);
}

// Where one (sequence, KV head) item reads: its head's rows in the pool.
struct Rows {
  const int32_t* table;
  int64_t first, context_len, block_size, block_elems, row_stride, head_dim;

  template <typename Visit>
  void each(const int8_t* head, Visit visit) const {
    llmaccel::for_each_row(head, table, first, context_len, block_size, block_elems, row_stride,
                           head_dim + kScaleBytes, visit);
  }
};

#ifdef LLMACCEL_KV_INT8_AVX512
inline __m512 widen16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Pass 1 at head_dim 16 * DV: each key row widened once into registers, every query head of the group
// against it, the sum scaled by the row's scale.
template <int DV>
void score_keys(const int8_t* k_head, const Rows& rows, const float* qf, int64_t group, int64_t len, float* scores) {
  rows.each(k_head, [&](const int8_t* row, int64_t t) {
    __m512 key[DV];
    for (int d = 0; d < DV; ++d) key[d] = widen16(row + 16 * d);
    const float key_scale = row_scale(row, 16 * DV);
    for (int64_t h = 0; h < group; ++h) {
      const float* q = qf + h * DV * 16;
      __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), key[0]);
      __m512 b = _mm512_mul_ps(_mm512_loadu_ps(q + 16), key[1]);
      for (int d = 2; d < DV; d += 2) {
        a = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * d), key[d], a);
        b = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * d + 16), key[d + 1], b);
      }
      scores[h * len + t] = _mm512_reduce_add_ps(_mm512_add_ps(a, b)) * key_scale;
    }
  });
}

// Pass 2: the weighted value rows for query heads h0 .. h0 + HC - 1, HC x DV accumulators in registers.
template <int DV, int HC>
void weigh_values(const int8_t* v_head, const Rows& rows, const float* scores, int64_t len, int64_t h0, float* acc) {
  __m512 sum[HC][DV];
  for (int h = 0; h < HC; ++h)
    for (int d = 0; d < DV; ++d) sum[h][d] = _mm512_setzero_ps();
  rows.each(v_head, [&](const int8_t* row, int64_t t) {
    __m512 v[DV];
    for (int d = 0; d < DV; ++d) v[d] = widen16(row + 16 * d);
    const float value_scale = row_scale(row, 16 * DV);
    for (int h = 0; h < HC; ++h) {
      const __m512 w = _mm512_set1_ps(scores[(h0 + h) * len + t] * value_scale);
      for (int d = 0; d < DV; ++d) sum[h][d] = _mm512_fmadd_ps(w, v[d], sum[h][d]);
    }
  });
  for (int h = 0; h < HC; ++h)
    for (int d = 0; d < DV; ++d) _mm512_storeu_ps(acc + (h0 + h) * DV * 16 + 16 * d, sum[h][d]);
}

// The group's heads in passes of up to 16 accumulators (four heads at head_dim 64, two at 128).
template <int DV>
void weigh_group(const int8_t* v_head, const Rows& rows, const float* scores, int64_t len, int64_t group,
                 float* acc) {
  for (int64_t h0 = 0; h0 < group;) {
    const int64_t left = group - h0;
    if (DV == 4 && left >= 4) {
      weigh_values<DV, 4>(v_head, rows, scores, len, h0, acc), h0 += 4;
    } else if (DV == 4 && left == 3) {
      weigh_values<DV, 3>(v_head, rows, scores, len, h0, acc), h0 += 3;
    } else if (left >= 2) {
      weigh_values<DV, 2>(v_head, rows, scores, len, h0, acc), h0 += 2;
    } else {
      weigh_values<DV, 1>(v_head, rows, scores, len, h0, acc), h0 += 1;
    }
  }
}
#endif

// Any head_dim, any instruction set: each row widened into `widened`, loops the compiler vectorises.
void score_keys_portable(const int8_t* k_head, const Rows& rows, const float* qf, int64_t group, int64_t len,
                         float* widened, float* scores) {
  const int64_t head_dim = rows.head_dim;
  rows.each(k_head, [&](const int8_t* row, int64_t t) {
    for (int64_t d = 0; d < head_dim; ++d) widened[d] = static_cast<float>(row[d]);
    const float key_scale = row_scale(row, head_dim);
    for (int64_t h = 0; h < group; ++h) {
      float sum = 0.0f;
      for (int64_t d = 0; d < head_dim; ++d) sum += qf[h * head_dim + d] * widened[d];
      scores[h * len + t] = sum * key_scale;
    }
  });
}

void weigh_values_portable(const int8_t* v_head, const Rows& rows, const float* scores, int64_t len, int64_t group,
                           float* widened, float* acc) {
  const int64_t head_dim = rows.head_dim;
  rows.each(v_head, [&](const int8_t* row, int64_t t) {
    for (int64_t d = 0; d < head_dim; ++d) widened[d] = static_cast<float>(row[d]);
    const float value_scale = row_scale(row, head_dim);
    for (int64_t h = 0; h < group; ++h) {
      const float w = scores[h * len + t] * value_scale;
      float* acc_h = acc + h * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) acc_h[d] += w * widened[d];
    }
  });
}

// One (sequence, KV head) item, as paged_attention.cpp's attend for float caches: pass 1 scores every key
// for the group's query heads, softmax per head, pass 2 sums the weighted values.
template <typename T>
LLMACCEL_ONE_COPY void attend(const T* q_group, const int8_t* k_cache, const int8_t* v_cache, const int32_t* table,
                              int64_t context_len, int64_t window, int64_t kvh, int64_t group, int64_t num_kv_heads,
                              int64_t head_dim, int64_t block_size, float scale, float softcap, T* out_group,
                              llmaccel::AttentionScratch& scratch) {
  const int64_t head_stride = head_dim + kScaleBytes, row_stride = num_kv_heads * head_stride;
  const int64_t first = window > 0 ? std::max<int64_t>(0, context_len - window) : 0;
  const int64_t len = context_len - first;
  const Rows rows{table, first, context_len, block_size, block_size * row_stride, row_stride, head_dim};
  scratch.qf.resize(group * head_dim);
  scratch.acc.assign(group * head_dim, 0.0f);
  scratch.inv_sum.resize(group);
  if (static_cast<int64_t>(scratch.scores.size()) < group * len) scratch.scores.resize(group * len);
  scratch.widened.resize(head_dim);
  float *qf = scratch.qf.data(), *acc = scratch.acc.data(), *scores = scratch.scores.data();
  for (int64_t i = 0; i < group * head_dim; ++i) qf[i] = llmaccel::to_float(q_group[i]) * scale;
  const int8_t *k_head = k_cache + kvh * head_stride, *v_head = v_cache + kvh * head_stride;
#ifdef LLMACCEL_KV_INT8_AVX512
  const bool wide = head_dim == 64 || head_dim == 128;
#else
  const bool wide = false;
#endif
  if (!wide) {
    score_keys_portable(k_head, rows, qf, group, len, scratch.widened.data(), scores);
  } else {
#ifdef LLMACCEL_KV_INT8_AVX512
    if (head_dim == 64)
      score_keys<4>(k_head, rows, qf, group, len, scores);
    else
      score_keys<8>(k_head, rows, qf, group, len, scores);
#endif
  }
  if (softcap > 0.0f) llmaccel::softcap_inplace(scores, group * len, softcap);
  for (int64_t h = 0; h < group; ++h) scratch.inv_sum[h] = llmaccel::softmax_inplace(scores + h * len, len);
  if (!wide) {
    weigh_values_portable(v_head, rows, scores, len, group, scratch.widened.data(), acc);
  } else {
#ifdef LLMACCEL_KV_INT8_AVX512
    if (head_dim == 64)
      weigh_group<4>(v_head, rows, scores, len, group, acc);
    else
      weigh_group<8>(v_head, rows, scores, len, group, acc);
#endif
  }
  for (int64_t h = 0; h < group; ++h)
    for (int64_t d = 0; d < head_dim; ++d)
      out_group[h * head_dim + d] = llmaccel::round_to<T>(acc[h * head_dim + d] * scratch.inv_sum[h]);
}

template <typename T>
void decode_kernel(const T* q, int64_t q_stride, const int8_t* k_cache, const int8_t* v_cache,
                   const int32_t* block_tables, const int32_t* context_lens, T* out, int64_t num_seqs,
                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                   int64_t window, float scale, float softcap) {
  const int64_t group = num_heads / num_kv_heads;
  llmaccel::for_each_decode_item(
      num_seqs, num_kv_heads,
      [&](int64_t seq, int64_t kvh) {
        llmaccel::prefetch_item_rows(k_cache, v_cache, block_tables + seq * max_blocks, context_lens[seq], window,
                                     kvh, num_kv_heads, head_dim + kScaleBytes, block_size);
      },
      [&](int64_t seq, int64_t kvh, llmaccel::AttentionScratch& scratch) {
        attend(q + seq * q_stride + kvh * group * head_dim, k_cache, v_cache, block_tables + seq * max_blocks,
               context_lens[seq], window, kvh, group, num_kv_heads, head_dim, block_size, scale, softcap,
               out + (seq * num_heads + kvh * group) * head_dim, scratch);
      });
}

void check_int8_cache(const torch::Tensor& cache, int64_t head_dim) {
  TORCH_CHECK(cache.dim() == 3 && cache.is_contiguous() && cache.scalar_type() == torch::kInt8 &&
                  cache.size(2) == head_dim + kScaleBytes,
              "an INT8 KV cache must be contiguous int8 [num_slots, KVH, head_dim + 2], got ", cache.sizes(),
              " for head_dim ", head_dim);
}

}  // namespace

// The decode stack's calls (kernels.h), one compiled copy each.
void llmaccel::quantize_kv_row(const float* x, int64_t head_dim, int8_t* out) { quantize_row(x, head_dim, out); }
void llmaccel::quantize_kv_row(const bf16* x, int64_t head_dim, int8_t* out) { quantize_row(x, head_dim, out); }

void llmaccel::attend_item(const float* q, const int8_t* k_cache, const int8_t* v_cache, const int32_t* table,
                           int64_t len, int64_t window, int64_t kv_head, int64_t group, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, float scale, float softcap, float* out,
                           AttentionScratch& scratch) {
  attend(q, k_cache, v_cache, table, len, window, kv_head, group, num_kv_heads, head_dim, block_size, scale, softcap,
         out, scratch);
}

void llmaccel::attend_item(const bf16* q, const int8_t* k_cache, const int8_t* v_cache, const int32_t* table,
                           int64_t len, int64_t window, int64_t kv_head, int64_t group, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, float scale, float softcap, bf16* out,
                           AttentionScratch& scratch) {
  attend(q, k_cache, v_cache, table, len, window, kv_head, group, num_kv_heads, head_dim, block_size, scale, softcap,
         out, scratch);
}

void llmaccel::prefetch_item(const int8_t* k_cache, const int8_t* v_cache, const int32_t* table, int64_t len,
                             int64_t window, int64_t kv_head, int64_t num_kv_heads, int64_t head_dim,
                             int64_t block_size) {
  llmaccel::prefetch_item_rows(k_cache, v_cache, table, len, window, kv_head, num_kv_heads, head_dim + kScaleBytes,
                               block_size);
}

// paged_decode_attention (paged_attention.cpp) for INT8 caches: q [S, H, D] float32 or bfloat16 (rows may
// be strided), caches [num_slots, KVH, D + 2] int8. Returns [S, H, D] in q's dtype.
torch::Tensor paged_decode_attention_int8(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                          torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size,
                                          int64_t window, double scale, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "each query row must be contiguous");
  check_int8_cache(k_cache, q.size(2));
  check_int8_cache(v_cache, q.size(2));
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && context_lens.scalar_type() == torch::kInt32,
              "block_tables and context_lens must be int32");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = torch::empty(q.sizes(), q.options());
  auto run = [&](auto* q_data, auto* out_data) {
    decode_kernel(q_data, q.stride(0), k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(),
                  tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), out_data, q.size(0), q.size(1),
                  k_cache.size(1), q.size(2), block_size, tables.size(1), window, static_cast<float>(scale),
                  static_cast<float>(softcap));
  };
  if (q.scalar_type() == torch::kFloat32)
    run(q.data_ptr<float>(), out.data_ptr<float>());
  else if (q.scalar_type() == at::kBFloat16)
    run(q.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
  else
    TORCH_CHECK(false, "an INT8 KV cache takes float32 or bfloat16 queries, got ", q.scalar_type());
  return out;
}

// write_kv (paged_attention.cpp) for INT8 caches: each new key and value row [T, KVH, D] (float32 or
// bfloat16, rows may be strided) quantized into its slot.
void write_kv_int8(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor slots) {
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes(), "k and v must be [T, KVH, D] alike");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "each key and value row must be contiguous");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "k and v dtypes differ");
  const int64_t tokens = k.size(0), heads = k.size(1), head_dim = k.size(2);
  check_int8_cache(k_cache, head_dim);
  check_int8_cache(v_cache, head_dim);
  TORCH_CHECK(k_cache.size(1) == heads, "the caches hold ", k_cache.size(1), " KV heads, the keys ", heads);
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous() && slots.numel() == tokens,
              "slots must be contiguous int64 [T]");
  const int64_t num_slots = k_cache.size(0), head_stride = head_dim + kScaleBytes;
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)  // all checked before any is written
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot ", slot[t], " is outside the KV pool of ", num_slots);
  auto run = [&](auto* k_data, auto* v_data) {
    int8_t *k_dst = k_cache.data_ptr<int8_t>(), *v_dst = v_cache.data_ptr<int8_t>();
    at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t offset = (slot[t] * heads + h) * head_stride;
          quantize_row(k_data + t * k.stride(0) + h * head_dim, head_dim, k_dst + offset);
          quantize_row(v_data + t * v.stride(0) + h * head_dim, head_dim, v_dst + offset);
        }
    });
  };
  if (k.scalar_type() == torch::kFloat32)
    run(k.data_ptr<float>(), v.data_ptr<float>());
  else if (k.scalar_type() == at::kBFloat16)
    run(k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>());
  else
    TORCH_CHECK(false, "an INT8 KV cache takes float32 or bfloat16 keys and values, got ", k.scalar_type());
}
