// A projection's LoRA adapters as lora/layers.py stacks them, and the two halves of adding their deltas: the
// rows' shrinks (A_s x) and their expansions into a range of columns (B_s shrink). lora.cpp's entry point runs both
// for the layer-by-layer path; the decode stack (decode_stack.cpp) runs them inside its parallel region.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels.h"

namespace llmaccel {

// a [slots x share, K] and b_t [slots x share, N] (the scaling folded into b_t), part_columns int64 [P, 2]: the
// columns part p's `share / P` rows of each adapter's b_t touch (q, k and v, or gate and up, where fused)
struct LoRAWeights {
  at::Tensor a, b_t, part_columns;
  int64_t share = 0;
  bool defined() const { return share > 0; }
};

// shrink[p] for pairs p in [p0, p1) of (row r of `rows`, j < share): the dot of x's row rows[r] with its
// adapter's row j of A, rounded to T as a T matmul's output is. Four rows of A a pass over the row of x (widened
// to float once), so a pass loads each x value once for four products.
template <typename T>
void lora_shrink(const T* x, int64_t ldx, int64_t k, const T* a, int64_t share, const int64_t* rows,
                 const int64_t* slots, int64_t p0, int64_t p1, float* shrink) {
  std::vector<float> xf(k);
  int64_t widened = -1;  // the row of `rows` xf holds
  for (int64_t p = p0; p < p1;) {
    const int64_t r = p / share, j = p % share;
    if (widened != r) {
      const T* xi = x + rows[r] * ldx;
      for (int64_t c = 0; c < k; ++c) xf[c] = to_float(xi[c]);
      widened = r;
    }
    const T* aj = a + (slots[rows[r]] * share + j) * k;
    if (j + 4 <= share && p + 4 <= p1) {
      float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
      for (int64_t c = 0; c < k; ++c) {
        const float v = xf[c];
        s0 += v * to_float(aj[c]), s1 += v * to_float(aj[k + c]);
        s2 += v * to_float(aj[2 * k + c]), s3 += v * to_float(aj[3 * k + c]);
      }
      shrink[p] = rounded<T>(s0), shrink[p + 1] = rounded<T>(s1);
      shrink[p + 2] = rounded<T>(s2), shrink[p + 3] = rounded<T>(s3);
      p += 4;
    } else {
      float sum = 0.0f;
      for (int64_t c = 0; c < k; ++c) sum += xf[c] * to_float(aj[c]);
      shrink[p++] = rounded<T>(sum);
    }
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
          for (int64_t c = lo; c < hi; ++c)
            acc[c - b0] += s[j] * to_float(q0[c]) + s[j + 1] * to_float(q1[c]) + s[j + 2] * to_float(q2[c]) +
                           s[j + 3] * to_float(q3[c]);
        }
        for (; j < (part + 1) * rank; ++j)
          for (int64_t c = lo; c < hi; ++c) acc[c - b0] += s[j] * to_float(b_rows[j * n + c]);
      }
      T* yi = y + rows[r] * ldy;
      for (int64_t c = b0; c < b1; ++c) yi[c] = round_to<T>(to_float(yi[c]) + rounded<T>(acc[c - b0]));
    }
  }
}

}  // namespace llmaccel
