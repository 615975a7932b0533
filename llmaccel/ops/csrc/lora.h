// A projection's LoRA adapters as lora/layers.py stacks them, and the two halves of adding their deltas: the
// rows' shrinks (A_s x) and their expansions into a range of columns (B_s shrink). lora.cpp's entry point runs both
// for the layer-by-layer path; the decode stack (decode_stack.cpp) runs them inside its parallel region.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define LLMACCEL_LORA_AVX512 1
#endif

namespace llmaccel {

#if defined(LLMACCEL_LORA_AVX512)
// 16 values from p (those `mask` keeps; the rest 0) as floats: bfloat16 widened by a shift, float32 as it is
// (a masked load only for a row's last, partial 16: on Zen 4 a masked 16-bit load costs several plain ones)
inline __m512 lora_load16(const c10::BFloat16* p, __mmask16 mask) {
  const __m256i bits = mask == 0xFFFF ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                      : _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 lora_load16(const float* p, __mmask16 mask) {
  return mask == 0xFFFF ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(mask, p);
}
inline __mmask16 lora_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}
// v rounded to bfloat16 as round_to does (to nearest even, NaN to 0x7fc0), as 16 bit patterns
inline __m256i lora_round16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}
// y[c] = round(y[c] + round(acc[c])) for 16 columns (`mask` of them): a T matmul's output added to y in T
inline void lora_add16(c10::BFloat16* y, const float* acc, __mmask16 mask) {
  const __m512 delta = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(lora_round16(_mm512_maskz_loadu_ps(mask, acc))), 16));
  _mm256_mask_storeu_epi16(y, mask, lora_round16(_mm512_add_ps(lora_load16(y, mask), delta)));
}
inline void lora_add16(float* y, const float* acc, __mmask16 mask) {
  _mm512_mask_storeu_ps(y, mask, _mm512_add_ps(_mm512_maskz_loadu_ps(mask, y), _mm512_maskz_loadu_ps(mask, acc)));
}
#endif

// a [slots x share, K] and b_t [slots x share, N] (the scaling folded into b_t), part_columns int64 [P, 2]: the
// columns part p's `share / P` rows of each adapter's b_t touch (q, k and v, or gate and up, where fused)
struct LoRAWeights {
  at::Tensor a, b_t, part_columns;
  int64_t share = 0;
  bool defined() const { return share > 0; }
};

// The matrices of LoRAWeights for a projection of K inputs and N outputs in `dtype`, checked.
inline void check_lora_weights(const at::Tensor& a, const at::Tensor& b_t, int64_t share, const at::Tensor& part_columns,
                               at::ScalarType dtype, int64_t k, int64_t n) {
  TORCH_CHECK(a.scalar_type() == dtype && b_t.scalar_type() == dtype && a.is_contiguous() && b_t.is_contiguous() &&
                  a.dim() == 2 && b_t.dim() == 2 && a.size(1) == k && b_t.size(1) == n && a.size(0) == b_t.size(0),
              "LoRA matrices must be contiguous a [slots x share, ", k, "] and b_t [slots x share, ", n, "] of ", dtype);
  TORCH_CHECK(share > 0 && a.size(0) % share == 0, "a's rows must be whole shares");
  TORCH_CHECK(part_columns.scalar_type() == at::kLong && part_columns.is_contiguous() && part_columns.dim() == 2 &&
                  part_columns.size(1) == 2 && part_columns.size(0) > 0 && share % part_columns.size(0) == 0,
              "part_columns must be contiguous int64 [P, 2], P dividing share");
  const int64_t* parts = part_columns.data_ptr<int64_t>();
  for (int64_t p = 0; p < part_columns.size(0); ++p)
    TORCH_CHECK(0 <= parts[2 * p] && parts[2 * p] <= parts[2 * p + 1] && parts[2 * p + 1] <= n,
                "part ", p, "'s columns are outside 0..", n);
}

// The rows of a step with an adapter (slots[i] >= 0; every slot checked against the `num_slots` the matrices
// hold), those of one adapter side by side: each reads its adapter's A and B^T while the last row's are in cache.
inline std::vector<int64_t> lora_rows(const int64_t* slots, int64_t m, int64_t num_slots) {
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < m; ++i) {
    TORCH_CHECK(slots[i] >= -1 && slots[i] < num_slots, "row ", i, "'s adapter slot ", slots[i], " is outside 0..",
                num_slots - 1);
    if (slots[i] >= 0) rows.push_back(i);
  }
  std::stable_sort(rows.begin(), rows.end(), [&](int64_t i, int64_t j) { return slots[i] < slots[j]; });
  return rows;
}

// shrink[r * share + j] for rows r0 <= r < r1 of `rows` (sorted by slot) and every j < share: the dot of x's row
// rows[r] with its adapter's row j of A, rounded to T as a T matmul's output is. Rows of one adapter go together,
// four rows of A at a time against each of them, so an A row comes from memory once an adapter. With AVX512-BF16
// the bf16 pairs go straight into vdpbf16ps, 32 products an instruction (64 rows at the default model's q/k/v, one
// thread of a Zen 4: 32 us, against 69 widening each value to float for an FMA; its sums round differently).
template <typename T>
void lora_shrink(const T* x, int64_t ldx, int64_t k, const T* a, int64_t share, const int64_t* rows,
                 const int64_t* slots, int64_t r0, int64_t r1, float* shrink) {
  std::vector<float> xf;
  for (int64_t g0 = r0; g0 < r1;) {
    int64_t g1 = g0 + 1;  // rows g0 .. g1 - 1 share an adapter
    while (g1 < r1 && slots[rows[g1]] == slots[rows[g0]]) ++g1;
    const T* as = a + slots[rows[g0]] * share * k;
    int64_t j = 0;
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {  // bf16 pairs straight into vdpbf16ps: 32 products a step
      for (; j + 4 <= share; j += 4) {
        const T* aj = as + j * k;
        for (int64_t r = g0; r < g1; ++r) {
          const T* xr = x + rows[r] * ldx;
          __m512 v0 = _mm512_setzero_ps(), v1 = v0, v2 = v0, v3 = v0;
          for (int64_t c = 0; c < k; c += 32) {
            const __mmask32 m = k - c >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1ull << (k - c)) - 1);
            auto load = [&](const T* p) {
              return (__m512bh)(k - c >= 32 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(m, p));
            };
            const __m512bh xv = load(xr + c);
            v0 = _mm512_dpbf16_ps(v0, xv, load(aj + c));
            v1 = _mm512_dpbf16_ps(v1, xv, load(aj + k + c));
            v2 = _mm512_dpbf16_ps(v2, xv, load(aj + 2 * k + c));
            v3 = _mm512_dpbf16_ps(v3, xv, load(aj + 3 * k + c));
          }
          float* out = shrink + r * share + j;
          out[0] = rounded<T>(_mm512_reduce_add_ps(v0)), out[1] = rounded<T>(_mm512_reduce_add_ps(v1));
          out[2] = rounded<T>(_mm512_reduce_add_ps(v2)), out[3] = rounded<T>(_mm512_reduce_add_ps(v3));
        }
      }
    }
#endif
    if (j < share) {  // the rows widened to float once for the loops below
      xf.resize((g1 - g0) * k);
      for (int64_t r = g0; r < g1; ++r)
        for (int64_t c = 0; c < k; ++c) xf[(r - g0) * k + c] = to_float(x[rows[r] * ldx + c]);
    }
    for (; j + 4 <= share; j += 4) {
      const T* aj = as + j * k;
      for (int64_t r = g0; r < g1; ++r) {
        const float* xr = xf.data() + (r - g0) * k;
#if defined(LLMACCEL_LORA_AVX512)
        __m512 v0 = _mm512_setzero_ps(), v1 = v0, v2 = v0, v3 = v0;
        for (int64_t c = 0; c < k; c += 16) {
          const __mmask16 m = lora_mask(k - c);
          const __m512 xv = lora_load16(xr + c, m);
          v0 = _mm512_fmadd_ps(xv, lora_load16(aj + c, m), v0);
          v1 = _mm512_fmadd_ps(xv, lora_load16(aj + k + c, m), v1);
          v2 = _mm512_fmadd_ps(xv, lora_load16(aj + 2 * k + c, m), v2);
          v3 = _mm512_fmadd_ps(xv, lora_load16(aj + 3 * k + c, m), v3);
        }
        const float s0 = _mm512_reduce_add_ps(v0), s1 = _mm512_reduce_add_ps(v1);
        const float s2 = _mm512_reduce_add_ps(v2), s3 = _mm512_reduce_add_ps(v3);
#else
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
        for (int64_t c = 0; c < k; ++c) {
          const float v = xr[c];
          s0 += v * to_float(aj[c]), s1 += v * to_float(aj[k + c]);
          s2 += v * to_float(aj[2 * k + c]), s3 += v * to_float(aj[3 * k + c]);
        }
#endif
        float* out = shrink + r * share + j;
        out[0] = rounded<T>(s0), out[1] = rounded<T>(s1), out[2] = rounded<T>(s2), out[3] = rounded<T>(s3);
      }
    }
    for (; j < share; ++j)
      for (int64_t r = g0; r < g1; ++r) {
        float sum = 0.0f;
        for (int64_t c = 0; c < k; ++c) sum += xf[(r - g0) * k + c] * to_float(as[j * k + c]);
        shrink[r * share + j] = rounded<T>(sum);
      }
    g0 = g1;
  }
}

// y[rows[r], c] += (b_t's rows of the row's adapter) . shrink, for columns [c0, c1), each part's rows over its own
// columns only; the expansion rounded to T, then the sum (a T matmul's output added to y in T). Four rows of b_t a
// pass over a run of columns' sums.
template <typename T>
void lora_expand(const float* shrink, int64_t count, const T* bt, int64_t n, int64_t share, const int64_t* parts,
                 int64_t num_parts, const int64_t* rows, const int64_t* slots, T* y, int64_t ldy, int64_t c0,
                 int64_t c1) {
  constexpr int64_t kColumns = 64;  // a run of columns' sums in one float buffer
  const int64_t rank = share / num_parts;
  float acc[kColumns];
  for (int64_t b0 = c0; b0 < c1; b0 += kColumns) {
    const int64_t b1 = std::min(c1, b0 + kColumns);
    for (int64_t r = 0; r < count; ++r) {
      std::fill(acc, acc + kColumns, 0.0f);
      const T* b_rows = bt + slots[rows[r]] * share * n;
      const float* s = shrink + r * share;
      for (int64_t part = 0; part < num_parts; ++part) {
        const int64_t lo = std::max(b0, parts[2 * part]), hi = std::min(b1, parts[2 * part + 1]);
        if (lo >= hi) continue;
        int64_t j = part * rank;
        for (; j + 4 <= (part + 1) * rank; j += 4) {
          const T *q0 = b_rows + j * n, *q1 = q0 + n, *q2 = q1 + n, *q3 = q2 + n;
#if defined(LLMACCEL_LORA_AVX512)
          const __m512 t0 = _mm512_set1_ps(s[j]), t1 = _mm512_set1_ps(s[j + 1]);
          const __m512 t2 = _mm512_set1_ps(s[j + 2]), t3 = _mm512_set1_ps(s[j + 3]);
          for (int64_t c = lo; c < hi; c += 16) {
            const __mmask16 m = lora_mask(hi - c);
            __m512 v = lora_load16(acc + c - b0, m);
            v = _mm512_fmadd_ps(t0, lora_load16(q0 + c, m), v);
            v = _mm512_fmadd_ps(t1, lora_load16(q1 + c, m), v);
            v = _mm512_fmadd_ps(t2, lora_load16(q2 + c, m), v);
            v = _mm512_fmadd_ps(t3, lora_load16(q3 + c, m), v);
            _mm512_mask_storeu_ps(acc + c - b0, m, v);
          }
          continue;
#endif
          for (int64_t c = lo; c < hi; ++c)
            acc[c - b0] += s[j] * to_float(q0[c]) + s[j + 1] * to_float(q1[c]) + s[j + 2] * to_float(q2[c]) +
                           s[j + 3] * to_float(q3[c]);
        }
        for (; j < (part + 1) * rank; ++j)
          for (int64_t c = lo; c < hi; ++c) acc[c - b0] += s[j] * to_float(b_rows[j * n + c]);
      }
      T* yi = y + rows[r] * ldy;
#if defined(LLMACCEL_LORA_AVX512)
      for (int64_t c = b0; c < b1; c += 16) lora_add16(yi + c, acc + c - b0, lora_mask(b1 - c));
#else
      for (int64_t c = b0; c < b1; ++c) yi[c] = round_to<T>(to_float(yi[c]) + rounded<T>(acc[c - b0]));
#endif
    }
  }
}

}  // namespace llmaccel
