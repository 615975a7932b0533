// Prefill attention on AVX512-BF16: a chunk of queries against its whole context, read from the paged
// KV pool through the context's slots, flash-style (an online softmax over blocks of 64 keys).
//
// torch's CPU flash attention ran at ~140 GFLOP/s in bfloat16 on a 2-core AMD EPYC Zen 4 (no AMX), a
// third of what vdpbf16ps gives the projections, so at an 8k prompt on the 1B shape attention took
// over half the prefill. Here both products run on vdpbf16ps:
// - scores: a row's query pairs (q[2p], q[2p + 1]) are broadcast against a block of 64 keys packed
//   pair-major (one register holds pair p of 16 keys), 4 rows at a time;
// - values: the probabilities, rounded to bfloat16 as torch's kernel rounds them, are broadcast in
//   pairs of keys against values packed (v[2j, d], v[2j + 1, d]) along d.
// The query heads that share a KV head are rows of one task, so a packed key block serves all of them.
//
// A row's result depends on nothing but its own query and keys: blocks are aligned to absolute key
// positions (0, 64, 128, ...) and visited in order, keys a row does not see score -inf and add exactly
// nothing, and the sums run in a fixed order. So a token's attention is the same to the bit whether its
// prompt is prefilled whole, in chunks of any size, or after a prefix-cache hit.
#include "aten.h"
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels.h"

namespace llmaccel {

#if defined(__AVX512BF16__) && defined(__AVX512F__)
namespace {

constexpr int64_t kKeys = 64;                    // keys per block
constexpr int kKeyRegs = kKeys / 16;               // registers of scores per row
constexpr int64_t kTaskRows = 64;                  // query rows (positions x the heads of one KV head) per task
constexpr int64_t kScoreRows = 16 / kKeyRegs;      // rows per score tile: 16 accumulators
constexpr int64_t kValueRows = 4;                  // rows per value tile: 4 x 64 dims, 16 accumulators

// exp(x) for finite x <= 0: n = round(x log2 e), exp(r) for the rest r = x - n ln 2 by its Taylor series to
// r^5 (|r| <= ln 2 / 2: relative error < 3e-6, against bfloat16 probabilities' 4e-3), scaled by 2^n (0 far
// below -87). Eight instructions: the softmax's exponentials share the multiply units with the products.
inline __m512 exp_ps(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147180559945f), x);
  __m512 p = _mm512_set1_ps(1.0f / 120);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

struct Row {
  const uint32_t* q;  // the query's pairs
  int64_t position;   // of the query, in the context
  bf16* out;          // nullptr: a padding row
};

// Scores of kScoreRows rows against one packed key block (pairs x kKeys keys), unscaled.
inline void score_tile(const Row* rows, const uint32_t* keys, int64_t pairs, float* scores) {
  __m512 acc[kScoreRows][kKeyRegs];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh k[kKeyRegs];
    for (int c = 0; c < kKeyRegs; ++c) k[c] = (__m512bh)_mm512_loadu_si512(keys + p * kKeys + 16 * c);
    for (int64_t i = 0; i < kScoreRows; ++i) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(rows[i].q[p]));
      for (int c = 0; c < kKeyRegs; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], k[c], b);
    }
  }
  for (int64_t i = 0; i < kScoreRows; ++i)
    for (int c = 0; c < kKeyRegs; ++c) _mm512_storeu_ps(scores + i * kKeys + 16 * c, acc[i][c]);
}

// out[i] = out[i] * alpha[i] + probs[i] . values for kValueRows rows and C x 16 dims from d0.
template <int C>
inline void value_tile(const uint32_t* probs, const float* alpha, const uint32_t* values, int64_t dim, int64_t d0,
                       float* out) {
  __m512 acc[kValueRows][C];
  for (int64_t i = 0; i < kValueRows; ++i) {  // times 1 is exact: skipped
    const __m512 a = _mm512_set1_ps(alpha[i]);
    for (int c = 0; c < C; ++c) {
      acc[i][c] = _mm512_loadu_ps(out + i * dim + d0 + 16 * c);
      if (alpha[i] != 1.0f) acc[i][c] = _mm512_mul_ps(acc[i][c], a);
    }
  }
  for (int64_t j = 0; j < kKeys / 2; ++j) {
    __m512bh v[C];
    for (int c = 0; c < C; ++c) v[c] = (__m512bh)_mm512_loadu_si512(values + j * dim + d0 + 16 * c);
    for (int64_t i = 0; i < kValueRows; ++i) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(probs[i * kKeys / 2 + j]));
      for (int c = 0; c < C; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], v[c], b);
    }
  }
  for (int64_t i = 0; i < kValueRows; ++i)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + i * dim + d0 + 16 * c, acc[i][c]);
}

// One key block, for keys [kKeys * b, kKeys * (b + 1)) of this block's packing.
struct Block {
  const uint32_t* keys;    // [dim / 2][32]: pair p of each key
  const uint32_t* values;  // [16][dim]: (v[2j, d], v[2j + 1, d])
  int64_t first_key;
};

// A thread's running state for up to kTaskRows rows: the softmax's max and sum, the unnormalised output.
struct Scratch {
  std::vector<float> max, sum, alpha, scores, out;
  std::vector<uint32_t> probs;
  Scratch(int64_t rows, int64_t dim)
      : max(rows), sum(rows * 16), alpha(rows), scores(rows * kKeys), out(rows * dim), probs(rows * kKeys / 2) {}
};

// The softmax step for one row and block: probabilities (bf16 pairs) and the factor its output is rescaled by.
// `sum` holds 16 lanes of partial sums (added up at the end: no horizontal sum a block).
inline void softmax_row(const Row& row, int64_t first_key, int64_t window, float scale, const float* scores,
                        float& max, float* sum, float& alpha, uint32_t* probs) {
  __m512 s[kKeyRegs];
  for (int c = 0; c < kKeyRegs; ++c) s[c] = _mm512_loadu_ps(scores + 16 * c);
  const int64_t lowest = window > 0 ? std::max<int64_t>(row.position - window + 1, 0) : 0;
  __mmask16 live[kKeyRegs];
  const bool masked = first_key + kKeys - 1 > row.position || first_key < lowest;
  if (masked) {
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i hi = _mm512_set1_epi32(static_cast<int>(row.position));
    const __m512i lo = _mm512_set1_epi32(static_cast<int>(lowest));
    const __m512 none = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    bool seen = false;
    for (int c = 0; c < kKeyRegs; ++c) {
      const __m512i key = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(first_key + 16 * c)));
      live[c] = _mm512_cmple_epi32_mask(key, hi) & _mm512_cmpge_epi32_mask(key, lo);
      seen |= live[c] != 0;
      s[c] = _mm512_mask_blend_ps(live[c], none, s[c]);
    }
    if (!seen) {  // no key of this block is seen: nothing changes
      alpha = 1.0f;
      std::fill(probs, probs + kKeys / 2, 0u);
      return;
    }
  }
  __m512 top_lanes = s[0];
  for (int c = 1; c < kKeyRegs; ++c) top_lanes = _mm512_max_ps(top_lanes, s[c]);
  // scale > 0: the largest score is the largest scaled one
  const float top = std::max(max, _mm512_reduce_max_ps(top_lanes) * scale);
  alpha = top == max ? 1.0f : std::exp(max - top);  // 0 at the first block seen (max = -inf)
  const __m512 t = _mm512_set1_ps(-top), sc = _mm512_set1_ps(scale);
  __m512 total = _mm512_mul_ps(_mm512_loadu_ps(sum), _mm512_set1_ps(alpha));
  for (int c = 0; c < kKeyRegs; c += 2) {
    __m512 p0 = exp_ps(_mm512_fmadd_ps(s[c], sc, t)), p1 = exp_ps(_mm512_fmadd_ps(s[c + 1], sc, t));
    if (masked) {  // exp(-inf) above is NaN: unseen keys weigh exactly 0
      p0 = _mm512_maskz_mov_ps(live[c], p0);
      p1 = _mm512_maskz_mov_ps(live[c + 1], p1);
    }
    total = _mm512_add_ps(total, _mm512_add_ps(p0, p1));
    _mm512_storeu_si512(probs + 8 * c, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
  }
  _mm512_storeu_ps(sum, total);
  max = top;
}

// Attention of rows [0, count) over the blocks (count a multiple of kScoreRows and kValueRows; rows past
// the real ones are padding).
void attend(const Row* rows, int64_t count, const std::vector<Block>& blocks, int64_t dim, int64_t window,
            float scale, Scratch& w) {
  std::fill(w.max.begin(), w.max.begin() + count, -std::numeric_limits<float>::infinity());
  std::fill(w.sum.begin(), w.sum.begin() + count * 16, 0.0f);
  std::fill(w.out.begin(), w.out.begin() + count * dim, 0.0f);
  const int64_t pairs = dim / 2;
  for (const Block& block : blocks) {
    for (int64_t r = 0; r < count; r += kScoreRows)
      score_tile(rows + r, block.keys, pairs, w.scores.data() + r * kKeys);
    for (int64_t r = 0; r < count; ++r)
      softmax_row(rows[r], block.first_key, window, scale, w.scores.data() + r * kKeys, w.max[r],
                  w.sum.data() + 16 * r, w.alpha[r], w.probs.data() + r * kKeys / 2);
    for (int64_t r = 0; r < count; r += kValueRows) {
      const uint32_t* probs = w.probs.data() + r * kKeys / 2;
      float* out = w.out.data() + r * dim;
      int64_t d0 = 0;
      for (; d0 + 64 <= dim; d0 += 64) value_tile<4>(probs, w.alpha.data() + r, block.values, dim, d0, out);
      if (d0 < dim) value_tile<2>(probs, w.alpha.data() + r, block.values, dim, d0, out);
    }
  }
  for (int64_t r = 0; r < count; ++r) {
    if (rows[r].out == nullptr) continue;
    const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_loadu_ps(w.sum.data() + 16 * r)));
    for (int64_t d = 0; d < dim; d += 16) {
      const __m512 o = _mm512_mul_ps(_mm512_loadu_ps(w.out.data() + r * dim + d), inverse);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(rows[r].out + d), (__m256i)_mm512_cvtneps_pbh(o));
    }
  }
}

// Key block b of KV head g, packed: keys pair-major, values in key pairs. Keys past the context are zero.
void pack_block(const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* slots, int64_t length,
                int64_t kv_heads, int64_t dim, int64_t g, int64_t first_key, uint32_t* keys, uint32_t* values) {
  const int64_t pairs = dim / 2, row_stride = kv_heads * dim;
  for (int64_t i = 0; i < kKeys; ++i) {
    const int64_t j = first_key + i;
    if (j >= length) {
      for (int64_t p = 0; p < pairs; ++p) keys[p * kKeys + i] = 0;
      continue;
    }
    const auto* k = reinterpret_cast<const uint32_t*>(k_cache + slots[j] * row_stride + g * dim);
    for (int64_t p = 0; p < pairs; ++p) keys[p * kKeys + i] = k[p];
  }
  for (int64_t j = 0; j < kKeys / 2; ++j) {
    const int64_t j0 = first_key + 2 * j, j1 = j0 + 1;
    uint32_t* out = values + j * dim;
    const uint16_t* v0 = j0 < length ? v_cache + slots[j0] * row_stride + g * dim : nullptr;
    const uint16_t* v1 = j1 < length ? v_cache + slots[j1] * row_stride + g * dim : nullptr;
    for (int64_t d = 0; d < dim; ++d)
      out[d] = (v0 ? v0[d] : 0u) | (static_cast<uint32_t>(v1 ? v1[d] : 0u) << 16);
  }
}

}  // namespace

bool prefill_attention_compiled() { return true; }

void prefill_attention_run(const bf16* q, int64_t q_row_stride, int64_t n, int64_t heads, int64_t kv_heads,
                           int64_t dim, const bf16* k_cache, const bf16* v_cache, const int64_t* slots,
                           int64_t length, int64_t window, float scale, bf16* out) {
  const int64_t group = heads / kv_heads, offset = length - n;
  const int64_t positions_per_task = std::max<int64_t>(1, kTaskRows / group);
  const int64_t tasks_per_head = (n + positions_per_task - 1) / positions_per_task;
  const int64_t first_block = window > 0 ? std::max<int64_t>(0, offset - window + 1) / kKeys : 0;
  const int64_t last_block = (length - 1) / kKeys;
  const int64_t num_blocks = last_block - first_block + 1;
  const int64_t block_words = kKeys * dim;  // keys (dim / 2 x kKeys) and values (kKeys / 2 x dim)
  std::vector<uint32_t> packed(static_cast<size_t>(kv_heads * num_blocks * block_words));
  const auto* kc = reinterpret_cast<const uint16_t*>(k_cache);
  const auto* vc = reinterpret_cast<const uint16_t*>(v_cache);
  const int64_t tasks = kv_heads * tasks_per_head;
  const int64_t row_capacity = (positions_per_task * group + kScoreRows - 1) / kScoreRows * kScoreRows;
#pragma omp parallel num_threads(at::get_num_threads())
  {
#pragma omp for schedule(static)
    for (int64_t item = 0; item < kv_heads * num_blocks; ++item) {
      uint32_t* keys = packed.data() + item * block_words;
      pack_block(kc, vc, slots, length, kv_heads, dim, item / num_blocks, (first_block + item % num_blocks) * kKeys,
                 keys, keys + dim / 2 * kKeys);
    }
    Scratch scratch(row_capacity, dim);
    std::vector<Row> rows(row_capacity);
    std::vector<Block> blocks;
    // The last positions see the most keys: handed out first, the two threads end together.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < tasks; ++item) {
      const int64_t t = tasks_per_head - 1 - item / kv_heads, g = item % kv_heads;
      const int64_t p0 = t * positions_per_task, p1 = std::min(n, p0 + positions_per_task);
      int64_t count = 0;
      for (int64_t i = p0; i < p1; ++i)
        for (int64_t h = 0; h < group; ++h, ++count) {
          const int64_t head = g * group + h;
          rows[count] = {reinterpret_cast<const uint32_t*>(q + i * q_row_stride + head * dim), offset + i,
                         out + (i * heads + head) * dim};
        }
      const int64_t padded = (count + kScoreRows - 1) / kScoreRows * kScoreRows;
      for (int64_t r = count; r < padded; ++r) rows[r] = {rows[count - 1].q, rows[count - 1].position, nullptr};
      const int64_t lowest = window > 0 ? std::max<int64_t>(0, offset + p0 - window + 1) : 0;
      blocks.clear();
      for (int64_t b = lowest / kKeys; b <= (offset + p1 - 1) / kKeys; ++b) {
        const uint32_t* keys = packed.data() + (g * num_blocks + b - first_block) * block_words;
        blocks.push_back({keys, keys + dim / 2 * kKeys, b * kKeys});
      }
      attend(rows.data(), padded, blocks, dim, window, scale, scratch);
    }
  }
}

#else
bool prefill_attention_compiled() { return false; }

void prefill_attention_run(const bf16*, int64_t, int64_t, int64_t, int64_t, int64_t, const bf16*, const bf16*,
                           const int64_t*, int64_t, int64_t, float, bf16*) {
  TORCH_CHECK(false, "the bfloat16 prefill attention needs AVX512-BF16");
}
#endif

}  // namespace llmaccel

bool prefill_attention_available() { return llmaccel::prefill_attention_compiled(); }

// q [n, H, D] bfloat16 (rows may be strided, as a view of the fused qkv projection), the pool's
// k_cache / v_cache [slots, KVH, D] bfloat16, slots [L] int64: the pool row of each context key, the
// chunk's own last. Query i sits at position L - n + i and sees keys up to there (and, with a window,
// the last `window` of them). Returns [n, H, D] bfloat16.
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                                int64_t window, double scale) {
  TORCH_CHECK(llmaccel::prefill_attention_compiled(), "the bfloat16 prefill attention needs AVX512-BF16");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kBFloat16, "q must be bfloat16 [n, heads, head_dim]");
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == dim, "q's heads must be contiguous within a row");
  TORCH_CHECK(dim % 32 == 0, "head_dim must be a multiple of 32, got ", dim);
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == dim &&
                  k_cache.scalar_type() == torch::kBFloat16 && v_cache.scalar_type() == torch::kBFloat16 &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "k_cache and v_cache must be contiguous bfloat16 [slots, kv_heads, ", dim, "]");
  const int64_t kv_heads = k_cache.size(1);
  TORCH_CHECK(heads % kv_heads == 0, "heads (", heads, ") must be a multiple of kv_heads (", kv_heads, ")");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == torch::kInt64, "slots must be int64 [context]");
  auto slot_ids = slots.contiguous();
  const int64_t length = slot_ids.size(0);
  TORCH_CHECK(length >= n, "the context (", length, " keys) must include the chunk's ", n, " queries");
  auto out = torch::empty({n, heads, dim}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (n == 0) return out;
  const int64_t* ids = slot_ids.data_ptr<int64_t>();
  const int64_t pool = k_cache.size(0);
  for (int64_t j = 0; j < length; ++j)
    TORCH_CHECK(ids[j] >= 0 && ids[j] < pool, "slot ", ids[j], " is outside the pool of ", pool);
  llmaccel::prefill_attention_run(q.data_ptr<at::BFloat16>(), q.stride(0), n, heads, kv_heads, dim,
                                  k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), ids, length,
                                  window, static_cast<float>(scale), out.data_ptr<at::BFloat16>());
  return out;
}
