// Random sampling of a batch's rows in one call: temperature, top-k, top-p, min-p, then one draw per
// row by the inverse CDF.
//
// torch's way (llmaccel/sampler.py, still the path off the CPU) sorts the whole vocabulary for top-k or
// top-p and draws an Exp(1) number per token for the race argmax(p / q): over a 49,152-token vocabulary
// that was 1.4 ms a row at temperature 1 and 5.9 ms with top_p = 0.9 (one row), 73 and 217 ms for 64
// rows: more than the forward pass, so a default chat request (temperature 1) decoded at two thirds the
// speed of a greedy one. Here a row costs ~0.1 ms: one pass for exp, a histogram of the probabilities
// by their float exponent (a power-of-two bucket each) finds how far down the top-k / top-p set can
// reach, and only the tokens above that bucket are sorted. The draw is one uniform number per row
// (from the row's own generator when seeded), scanned against the kept tokens in vocabulary order,
// exactly as the torch reference does (tests hold the two to the same token).
#include "aten.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels.h"

namespace llmaccel {
namespace {

constexpr int kBuckets = 128;  // float exponents of values in (0, 1]; bucket 0 holds zeros and denormals

inline int bucket_of(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return static_cast<int>(bits >> 23);  // v >= 0: the biased exponent, <= 127 for v <= 1
}

// The smallest value of bucket b (the bucket's lower edge; 0 for bucket 0).
inline float bucket_floor(int b) { return b == 0 ? 0.0f : std::ldexp(1.0f, b - 127); }

struct RowResult {
  int64_t token;
  float top;  // the largest probability of the distribution drawn from
};

// e holds exp(l / T - max) for the row (values in [0, 1], the top one exactly 1).
RowResult draw(const float* e, int64_t v, int64_t top_k, float top_p, float min_p, double u,
               std::vector<int32_t>& kept) {
  const bool by_k = top_k > 0 && top_k < v, by_p = top_p < 1.0f;
  kept.clear();
  double total = 0.0;
  if (!by_k && !by_p) {
    for (int64_t i = 0; i < v; ++i)
      if (e[i] >= min_p) total += e[i];
    const double target = u * total;
    double acc = 0.0;
    int64_t last = 0;
    for (int64_t i = 0; i < v; ++i)
      if (e[i] >= min_p) {
        acc += e[i];
        last = i;
        if (acc > target) return {i, static_cast<float>(1.0 / total)};
      }
    return {last, static_cast<float>(1.0 / total)};
  }
  // How far down the sorted order top-k and top-p can reach: walk the buckets from the top until
  // they hold k tokens (top-k) or a top_p share of the mass (top-p alone; with top-k the share is of
  // the top-k set, which lies above the k-bucket anyway).
  int64_t count[kBuckets] = {};
  double mass[kBuckets] = {};
  for (int64_t i = 0; i < v; ++i) {
    const int b = bucket_of(e[i]);
    ++count[b];
    mass[b] += e[i];
    total += e[i];
  }
  int floor_bucket = 0;
  int64_t seen = 0;
  double seen_mass = 0.0;
  for (int b = kBuckets - 1; b >= 0; --b) {
    seen += count[b];
    seen_mass += mass[b];
    if (by_k ? seen >= top_k : seen_mass >= top_p * total) {
      floor_bucket = b;
      break;
    }
  }
  const float floor_value = bucket_floor(floor_bucket);
  for (int64_t i = 0; i < v; ++i)
    if (e[i] >= floor_value) kept.push_back(static_cast<int32_t>(i));
  // descending probability, ties by vocabulary order (the order of a stable sort of the row)
  std::sort(kept.begin(), kept.end(), [e](int32_t a, int32_t b) { return e[a] > e[b] || (e[a] == e[b] && a < b); });
  if (by_k && static_cast<int64_t>(kept.size()) > top_k) kept.resize(top_k);
  if (by_p) {
    double set_mass = 0.0;
    if (by_k)
      for (int32_t i : kept) set_mass += e[i];
    else
      set_mass = total;
    double before = 0.0;
    size_t keep = kept.size();
    for (size_t j = 0; j < kept.size(); ++j) {
      if (j > 0 && before / set_mass > top_p) {
        keep = j;
        break;
      }
      before += e[kept[j]];
    }
    kept.resize(keep);
  }
  while (kept.size() > 1 && e[kept.back()] < min_p) kept.pop_back();  // min-p: the max is 1
  std::sort(kept.begin(), kept.end());  // the draw scans vocabulary order, as the reference does
  double kept_mass = 0.0;
  for (int32_t i : kept) kept_mass += e[i];
  const double target = u * kept_mass;
  double acc = 0.0;
  for (int32_t i : kept) {
    acc += e[i];
    if (acc > target) return {i, static_cast<float>(1.0 / kept_mass)};
  }
  return {kept.back(), static_cast<float>(1.0 / kept_mass)};
}

// The first index of the largest value of row[0 .. v), or of the first NaN.
int64_t first_max(const float* row, int64_t v) {
  int64_t i = 0;
  float peak = row[0];
#if defined(__AVX512F__)
  __m512 best = _mm512_set1_ps(row[0]);
  __mmask16 nan = 0;
  for (; i + 16 <= v; i += 16) {
    const __m512 x = _mm512_loadu_ps(row + i);
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, x);
  }
  peak = nan ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(best);
#endif
  for (; i < v; ++i) {
    if (row[i] != row[i]) {
      peak = row[i];
      break;
    }
    peak = row[i] > peak ? row[i] : peak;
  }
  int64_t at = 0;
  if (peak != peak) {
    while (row[at] == row[at]) ++at;
    return at;
  }
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(peak);
  for (; at + 16 <= v; at += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + at), target, _CMP_EQ_OQ);
    if (hit) return at + __builtin_ctz(hit);
  }
#endif
  while (row[at] != peak) ++at;
  return at;
}

}  // namespace
}  // namespace llmaccel

using namespace llmaccel;

// The first index of each row's largest value (of its first NaN, as torch.argmax), the rows split
// between the threads: torch's argmax took 1.4 ms over 64 rows of 49,152 logits, 2% of a decode step.
torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.stride(1) == 1 &&
                  logits.size(1) > 0,
              "logits must be float32 [B, V] with contiguous rows");
  const int64_t rows = logits.size(0), v = logits.size(1), ld = logits.stride(0);
  auto out = torch::empty({rows}, torch::kInt64);
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      op[r] = first_max(lp + r * ld, v);
    }
  });
  return out;
}

// logits float32 [B, V] (rows may be strided, columns contiguous); per row: temperature > 0, top_k (0 or
// >= V: none), top_p in (0, 1], min_p in [0, 1], and one uniform number in [0, 1) (float64).
// Returns the tokens (int64 [B]) and each row's top probability after truncation (float32 [B]).
std::vector<torch::Tensor> sample_rows(torch::Tensor logits, torch::Tensor temperature, torch::Tensor top_k,
                                       torch::Tensor top_p, torch::Tensor min_p, torch::Tensor uniform) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.stride(1) == 1,
              "logits must be float32 [B, V] with contiguous rows");
  const int64_t rows = logits.size(0), v = logits.size(1), ld = logits.stride(0);
  auto temp = temperature.to(torch::kFloat32).contiguous();
  auto k = top_k.to(torch::kInt64).contiguous();
  auto p = top_p.to(torch::kFloat32).contiguous();
  auto mp = min_p.to(torch::kFloat32).contiguous();
  auto un = uniform.to(torch::kFloat64).contiguous();
  for (const auto* t : {&temp, &k, &p, &mp, &un})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == rows, "sampling parameters must be one per row");
  auto tokens = torch::empty({rows}, torch::kInt64);
  auto top = torch::empty({rows}, torch::kFloat32);
  const float* lp = logits.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    thread_local std::vector<float> e;
    thread_local std::vector<int32_t> kept;
    e.resize(v);
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = lp + r * ld;
      const float t = temp.data_ptr<float>()[r];
      float peak = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < v; ++i) {
        e[i] = row[i] / t;
        peak = std::max(peak, e[i]);
      }
      if (!std::isfinite(peak)) {  // every logit -inf, or one +inf: nothing to draw from, take the argmax
        tokens.data_ptr<int64_t>()[r] = first_max(row, v);
        top.data_ptr<float>()[r] = 1.0f;
        continue;
      }
      for (int64_t i = 0; i < v; ++i) e[i] -= peak;
      exp_inplace(e.data(), v);
      for (int64_t i = 0; i < v; ++i)  // exp_inplace clamps at 2^-126: masked (-inf) tokens must stay at 0
        if (e[i] < 1e-37f) e[i] = 0.0f;
      const RowResult got = draw(e.data(), v, k.data_ptr<int64_t>()[r], p.data_ptr<float>()[r],
                                 mp.data_ptr<float>()[r], un.data_ptr<double>()[r], kept);
      tokens.data_ptr<int64_t>()[r] = got.token;
      top.data_ptr<float>()[r] = got.top;
    }
  });
  return {tokens, top};
}

// Grammar masks (structured outputs), in place: row rows[i] of logits keeps token t where bit t % 32 of
// word t / 32 of masks[i] is set (llguidance's and xgrammar's layout), and is -inf elsewhere. A word of
// all ones is skipped and one of zeros is a fill, so a JSON state (a few tokens allowed) costs a pass of
// stores; torch's unpack and masked_fill took 6 ms a step for 32 rows of 49,152 logits.
void mask_rows_(torch::Tensor logits, torch::Tensor rows, torch::Tensor masks) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.stride(1) == 1,
              "logits must be float32 [B, V] with contiguous rows");
  TORCH_CHECK(masks.dim() == 2 && masks.scalar_type() == torch::kInt32 && masks.is_contiguous(),
              "masks must be contiguous int32 [R, words]");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == torch::kInt64 && rows.size(0) == masks.size(0),
              "rows must be int64 [R], one per mask");
  const int64_t v = logits.size(1), ld = logits.stride(0), words = masks.size(1), n = rows.size(0);
  auto rows_c = rows.contiguous();
  const int64_t* rp = rows_c.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < logits.size(0), "a mask's row is outside the logits");
  float* lp = logits.data_ptr<float>();
  const uint32_t* mp = reinterpret_cast<const uint32_t*>(masks.data_ptr<int32_t>());
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, n, 4, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      float* row = lp + rp[i] * ld;
      const uint32_t* mask = mp + i * words;
      for (int64_t w = 0; w * 32 < v; ++w) {
        const uint32_t bits = w < words ? mask[w] : 0u;
        const int64_t start = w * 32, end = std::min<int64_t>(start + 32, v);
        if (bits == 0xffffffffu) continue;
        if (bits == 0u) {
          std::fill(row + start, row + end, neg_inf);
          continue;
        }
        if (end - start == 32) {
          float* at = row + start;
#if defined(__AVX512F__)  // two masked stores: -inf where a bit is clear
          const __m512 fill = _mm512_set1_ps(neg_inf);
          _mm512_mask_storeu_ps(at, static_cast<__mmask16>(~bits & 0xffffu), fill);
          _mm512_mask_storeu_ps(at + 16, static_cast<__mmask16>(~bits >> 16), fill);
#elif defined(__AVX2__)  // eight lanes at a time: a lane keeps its logit where its bit is set
          const __m256 fill = _mm256_set1_ps(neg_inf);
          const __m256i lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
          for (int k = 0; k < 32; k += 8) {
            const __m256i word = _mm256_set1_epi32(static_cast<int>((bits >> k) & 0xffu));
            const __m256i keep = _mm256_cmpeq_epi32(_mm256_and_si256(word, lane_bits), lane_bits);
            _mm256_storeu_ps(at + k, _mm256_blendv_ps(fill, _mm256_loadu_ps(at + k), _mm256_castsi256_ps(keep)));
          }
#else
          for (int k = 0; k < 32; ++k) at[k] = ((bits >> k) & 1u) ? at[k] : neg_inf;
#endif
          continue;
        }
        for (int64_t t = start; t < end; ++t)
          if (!((bits >> (t - start)) & 1u)) row[t] = neg_inf;
      }
    }
  });
}
