// The LoRA deltas of one projection for a step's rows, added in place: y[i] += B_s (A_s x[i]) for every row i whose
// adapter slot s = slots[i] is not -1 (lora/layers.py holds each projection's adapters stacked: A [slots x share,
// K] and B^T [slots x share, N], the scaling folded into B).
//
// In torch this was a gather, two batched matmuls, an index_select and an index_add a projection, ~300 us of
// dispatch each at the default model's shape, 120 projections a step: 64 requests over 8 adapters ran at 0.58x the
// base model's speed. Here it is one call: the rows' shrinks (A_s x, `share` dot products
// over K each) split between the threads, then the columns, each thread adding every adapter row's expansion to its
// own columns. Where q, k and v (or gate and up) are fused, adapter rows of a part touch only that part's columns
// (`part_columns`), so the block-diagonal zeros of B^T are skipped. The roundings are torch's for a bfloat16
// model: the shrink rounded to bfloat16, the expansion rounded, then the sum rounded.
#include "aten.h"
#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

#include "lora.h"

namespace llmaccel {
namespace {

template <typename T>
void add_deltas(T* y, const T* x, const T* a, const T* bt, const int64_t* slots, const std::vector<int64_t>& rows,
                int64_t k, int64_t n, int64_t share, const int64_t* parts, int64_t num_parts) {
  if (rows.empty()) return;
  const int64_t count = static_cast<int64_t>(rows.size());
  std::vector<float> shrink(count * share);
  at::parallel_for(0, count, 1, [&](int64_t r0, int64_t r1) {
    lora_shrink(x, k, k, a, share, rows.data(), slots, r0, r1, shrink.data());
  });
  at::parallel_for(0, n, 64, [&](int64_t c0, int64_t c1) {
    lora_expand(shrink.data(), count, bt, n, share, parts, num_parts, rows.data(), slots, y, n, c0, c1);
  });
}

}  // namespace
}  // namespace llmaccel

using namespace llmaccel;

// y [M, N] += the LoRA deltas of its rows (see above); x [M, K], a [S * share, K], b_t [S * share, N] of y's dtype,
// slots int64 [M] (-1: no adapter), part_columns int64 [P, 2]: the columns part p's rows of B^T touch (share = P x
// the rank each part holds).
void lora_add_(torch::Tensor y, torch::Tensor x, torch::Tensor a, torch::Tensor b_t, torch::Tensor slots,
               int64_t share, torch::Tensor part_columns) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.scalar_type() == x.scalar_type() && y.is_contiguous() &&
                  x.is_contiguous() && y.size(0) == x.size(0),
              "y [M, N] and x [M, K] must be contiguous, of one dtype");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, "float32 or bfloat16 only");
  const int64_t m = x.size(0), k = x.size(1), n = y.size(1);
  check_lora_weights(a, b_t, share, part_columns, x.scalar_type(), k, n);
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous() && slots.numel() == m,
              "slots must be contiguous int64 [M]");
  const int64_t* s = slots.data_ptr<int64_t>();
  const std::vector<int64_t> rows = lora_rows(s, m, a.size(0) / share);
  const int64_t* parts = part_columns.data_ptr<int64_t>();
  if (x.scalar_type() == torch::kFloat32)
    return add_deltas<float>(y.data_ptr<float>(), x.data_ptr<float>(), a.data_ptr<float>(), b_t.data_ptr<float>(), s,
                             rows, k, n, share, parts, part_columns.size(0));
  using T = at::BFloat16;
  add_deltas<T>(y.data_ptr<T>(), x.data_ptr<T>(), a.data_ptr<T>(), b_t.data_ptr<T>(), s, rows, k, n, share, parts,
                part_columns.size(0));
}
