// bfloat16 GEMM on AVX512-BF16 (vdpbf16ps) for batches: y[M, N] = x[M, K] @ W[N, K]^T, W in its plain
// layout (the one the streaming kernel and oneDNN read, so the model keeps one copy).
//
// oneDNN's bfloat16 GEMM reached 200-345 GFLOP/s at the decode shapes of a 64-sequence batch on a
// 2-core AMD EPYC Zen 4 (no AMX), whose vdpbf16ps peak is ~450 GFLOP/s (measured). This kernel turns the
// problem around: the activations, which are small and change every call, are packed so that one
// 512-bit register holds 16 rows' pairs (x[i, 2p], x[i, 2p + 1]); each weight pair W[n, 2p..2p+1] is
// broadcast from its plain row. A tile of 64 rows x 4 columns keeps 16 accumulators in registers, so
// each weight pair is read and broadcast once for a 64-sequence batch: 380-410 GFLOP/s at those shapes
// with the weights in cache (tools/gemv_bench.py; ops/kernel_choice.py times it against the others at
// start). With a step's weights coming from memory it ran 3-6% faster than the 32 x 8 tile it replaced,
// which read each weight twice at 64 rows (measured on a Zen 4 with 30 layers' distinct weights). Up to 16 rows a
// tile holds one register of rows, and 4 columns left 4 chains of vdpbf16ps waiting on its latency: 8 columns
// took a 1B-shaped layer's projections at 1-16 rows to 0.62x their time from memory (the compact layout's GEMM,
// decoding 8 rows at a time for it, to 0.58x; 2-core AMD EPYC Zen 5); tiles of 2 registers take 8 columns too, and
// 33-48 rows one tile of 3 (gemm_tile_cols, column_block). Every output sums
// its pairs in order p = 0, 1, ..., so a row's result does not depend on the tile, the thread or the
// rows beside it; the same GEMM reads the vnni layout too (bf16_gemm_vnni_columns), and linear_vnni.cpp's
// ordered_stream sums a few rows in this order, so --batch-invariant runs the two (ops/kernel_choice.py).
#include "aten.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace llmaccel {

#if defined(__AVX512BF16__) && defined(__AVX512F__)
namespace {

constexpr int kTileCols = 4;
constexpr int kWideCols = 8;  // gemm_tile_cols (kernels.h): up to 32 rows

// Other bytes a tile requests into L2 as it runs, one line every `steps` pairs: the compact layout's next
// rows (bf16_compact.cpp), which are decoded rather than read by the tile.
struct Ahead {
  const char* at = nullptr;
  int64_t bytes = 0, steps = 1;
};

// Rows [m0, m0 + 16 * MV) x columns [n0, n0 + NR) of y, rounded to bfloat16; `rows` of them are real.
// With `prefetch`, the next NR weight rows are requested a line at a time as these are read: the model's
// weights come from memory once a step, and waiting on them cost a quarter of the GEMM's time
// (45 against 34 ms for the default model's layers at 64 rows, measured cold against hot).
// `Vnni`: the weights in the vnni layout (linear_vnni.cpp: blocks of 32 columns, [K / 2, 32, 2]), where a
// column's pair p lies 32 pairs after its pair p - 1 rather than next to it; the sums are the same.
template <int MV, int NR, bool Vnni = false>
inline void tile(const uint32_t* packed, int64_t mp, const uint16_t* w, int64_t k, int64_t n0, int64_t m0,
                 int64_t rows, bf16* y, int64_t ldy, bool prefetch, const Ahead& ahead) {
  __m512 acc[MV][NR];
  for (int i = 0; i < MV; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  constexpr int64_t stride = Vnni ? kVnniBlock : 1;  // pairs from one of a column's pairs to the next
  const uint32_t* wr[NR];
  for (int j = 0; j < NR; ++j)
    wr[j] = Vnni ? reinterpret_cast<const uint32_t*>(w) + (n0 + j) / kVnniBlock * (k / 2 * kVnniBlock) +
                       (n0 + j) % kVnniBlock
                 : reinterpret_cast<const uint32_t*>(w + (n0 + j) * k);
  const uint32_t* a = packed + m0;
  const char* next = reinterpret_cast<const char*>(w + (n0 + NR) * k);
  for (int64_t p = 0; p < k / 2; ++p, a += mp) {
    if (prefetch && p % 16 == 0)
      for (int j = 0; j < NR; ++j) _mm_prefetch(next + (j * k + 2 * p) * 2, _MM_HINT_T0);
    if (ahead.bytes > 0 && p % ahead.steps == 0 && p / ahead.steps * 64 < ahead.bytes)
      _mm_prefetch(ahead.at + p / ahead.steps * 64, _MM_HINT_T1);
    __m512bh x[MV];
    for (int i = 0; i < MV; ++i) x[i] = (__m512bh)_mm512_loadu_si512(a + 16 * i);
    for (int j = 0; j < NR; ++j) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(wr[j][p * stride]));
      for (int i = 0; i < MV; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], x[i], b);
    }
  }
  // Rounded to bfloat16 (to nearest even, as c10 rounds) 16 lanes at a time, then written row by row.
  alignas(64) uint16_t lanes[NR][16];
  auto* out = reinterpret_cast<uint16_t*>(y);
  for (int i = 0; i < MV; ++i) {
    for (int j = 0; j < NR; ++j)
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[j]), (__m256i)_mm512_cvtneps_pbh(acc[i][j]));
    for (int64_t l = 0; l < 16 && 16 * i + l < rows; ++l) {
      uint16_t* row = out + (m0 + 16 * i + l) * ldy + n0;
      for (int j = 0; j < NR; ++j) row[j] = lanes[j][l];
    }
  }
}

// Columns [n0, n0 + NR) for every row: 64-row tiles, then one of 48, 32 or 16 for the rest (a tile reaches at
// most packed_rows(m)); 32 and 16 rows then 4 columns left 8 or 4 chains of vdpbf16ps waiting on its latency.
template <int NR, bool Vnni = false>
inline void column_block(const uint32_t* packed, int64_t m, const uint16_t* w, int64_t k, int64_t n0, bf16* y,
                         int64_t ldy, bool prefetch, const Ahead& ahead) {
  const int64_t mp = packed_rows(m);
  const Ahead none;
  int64_t m0 = 0;
  for (; m0 + 48 < m; m0 += 64)
    tile<4, NR, Vnni>(packed, mp, w, k, n0, m0, std::min<int64_t>(64, m - m0), y, ldy, prefetch && m0 == 0,
                      m0 == 0 ? ahead : none);
  // the rest (at most 48 rows) in one tile of as many registers as it needs
  const bool first = m0 == 0;
  if (m - m0 > 32)
    tile<3, NR, Vnni>(packed, mp, w, k, n0, m0, m - m0, y, ldy, prefetch && first, first ? ahead : none);
  else if (m - m0 > 16)
    tile<2, NR, Vnni>(packed, mp, w, k, n0, m0, m - m0, y, ldy, prefetch && first, first ? ahead : none);
  else if (m0 < m)
    tile<1, NR, Vnni>(packed, mp, w, k, n0, m0, m - m0, y, ldy, prefetch && first, first ? ahead : none);
}

}  // namespace

bool bf16_gemm_compiled() { return true; }

LLMACCEL_ONE_COPY void bf16_gemm_columns(const uint32_t* packed, int64_t m, const uint16_t* w, int64_t k, bf16* y,
                                         int64_t ldy, int64_t n0, int64_t n1, const uint8_t* ahead,
                                         int64_t ahead_bytes) {
  const int64_t width = gemm_tile_cols(m);
  // the bytes ahead shared out between the column blocks, each's spread over its pairs
  const int64_t blocks = std::max<int64_t>(1, (n1 - n0) / width);
  const int64_t share = (ahead_bytes / blocks + 63) / 64 * 64;
  auto ahead_of = [&](int64_t n) {
    Ahead a;
    if (ahead == nullptr || share == 0) return a;
    a.at = reinterpret_cast<const char*>(ahead) + (n - n0) / width * share;
    a.bytes = std::min(share, ahead_bytes - (n - n0) / width * share);
    a.steps = std::max<int64_t>(1, k / 2 / (share / 64));
    return a;
  };
  int64_t n = n0;
  if (width == kWideCols)
    for (; n + kWideCols <= n1; n += kWideCols)
      column_block<kWideCols>(packed, m, w, k, n, y, ldy, ahead == nullptr && n + 2 * kWideCols <= n1, ahead_of(n));
  for (; n + kTileCols <= n1; n += kTileCols)
    column_block<kTileCols>(packed, m, w, k, n, y, ldy, ahead == nullptr && n + 2 * kTileCols <= n1, ahead_of(n));
  for (; n < n1; ++n) column_block<1>(packed, m, w, k, n, y, ldy, false, Ahead());
}

LLMACCEL_ONE_COPY void bf16_gemm_vnni_columns(const uint32_t* packed, int64_t m, const uint16_t* w, int64_t k,
                                              bf16* y, int64_t ldy, int64_t n0, int64_t n1) {
  int64_t n = n0;  // (n0 a multiple of 8: a tile's columns never straddle two blocks of 32)
  if (gemm_tile_cols(m) == kWideCols)
    for (; n + kWideCols <= n1; n += kWideCols) column_block<kWideCols, true>(packed, m, w, k, n, y, ldy, false, Ahead());
  for (; n + kTileCols <= n1; n += kTileCols) column_block<kTileCols, true>(packed, m, w, k, n, y, ldy, false, Ahead());
  for (; n < n1; ++n) column_block<1, true>(packed, m, w, k, n, y, ldy, false, Ahead());
}
// Sixteen rows' pairs at a time, gathered into one register and stored in order: written one by one
// (strided by 64-256 bytes) the packing cost 3% of a 64-sequence decode step, each thread packing
// every projection's input for itself.
void pack_pairs(const bf16* x, int64_t ldx, int64_t m, int64_t k, std::vector<uint32_t>& out) {
  const int64_t mp = packed_rows(m);
  out.resize(k / 2 * mp);
  const auto* src = reinterpret_cast<const int*>(x);
  const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(static_cast<int>(ldx / 2)));
  for (int64_t i0 = 0; i0 < mp; i0 += 16) {
    const __mmask16 real = m - i0 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (m - i0)) - 1);
    const int* base = src + i0 * (ldx / 2);
    for (int64_t p = 0; p < k / 2; ++p) {
      const __m512i pairs = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), real, rows, base + p, 4);
      _mm512_storeu_si512(out.data() + p * mp + i0, pairs);
    }
  }
}

#else
bool bf16_gemm_compiled() { return false; }

void bf16_gemm_columns(const uint32_t*, int64_t, const uint16_t*, int64_t, bf16*, int64_t, int64_t, int64_t,
                       const uint8_t*, int64_t) {
  TORCH_CHECK(false, "the bfloat16 GEMM needs AVX512-BF16");
}

void bf16_gemm_vnni_columns(const uint32_t*, int64_t, const uint16_t*, int64_t, bf16*, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "the bfloat16 GEMM needs AVX512-BF16");
}

void pack_pairs(const bf16*, int64_t, int64_t, int64_t, std::vector<uint32_t>&) {
  TORCH_CHECK(false, "the bfloat16 GEMM needs AVX512-BF16");
}
#endif

}  // namespace llmaccel

namespace llmaccel {

torch::Tensor gemm_in_row_chunks(const torch::Tensor& x, int64_t n, const GemmColumns& columns, const GemmPass& pass) {
  auto xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1);
  auto y = torch::empty({m, n}, xc.options());
  if (m == 0) return y;
  auto* yp = y.data_ptr<at::BFloat16>();
  const int64_t chunk = gemm_chunk_rows(k);  // all packed first
  const int64_t chunks = (m + chunk - 1) / chunk;
  std::vector<std::vector<uint32_t>> packed(chunks);
  for (int64_t c = 0; c < chunks; ++c)
    pack_pairs(xc.data_ptr<at::BFloat16>() + c * chunk * k, k, std::min(chunk, m - c * chunk), k, packed[c]);
  // Every chunk of rows over a thread's columns a pass of them at a time, the pass's weights staying in L2 from
  // one chunk to the next: a weight comes from memory once, where a chunk at a time over all the columns read it
  // from memory once a chunk.
  const int64_t width = std::max<int64_t>(kPanel, (256 * 1024 / (2 * k)) / kPanel * kPanel);
  const int64_t blocks = (n + kPanel - 1) / kPanel;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t c0 = b0 * kPanel; c0 < std::min(n, b1 * kPanel); c0 += width) {
      const int64_t c1 = std::min({n, b1 * kPanel, c0 + width});
      if (pass) pass(c0, c1);
      for (int64_t c = 0; c < chunks; ++c) columns(packed[c].data(), std::min(chunk, m - c * chunk), yp + c * chunk * n, c0, c1);
    }
  });
  return y;
}

}  // namespace llmaccel

bool gemm_bf16_available() { return llmaccel::bf16_gemm_compiled(); }

// x bfloat16 [M, K] (K even), w bfloat16 [N, K] -> bfloat16 [M, N], no bias.
torch::Tensor gemm_bf16(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(llmaccel::bf16_gemm_compiled(), "the bfloat16 GEMM was not compiled (it needs AVX512-BF16)");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous(),
              "w must be contiguous bfloat16 [N, K]");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(k % 2 == 0, "K must be even, got ", k);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.scalar_type() == torch::kBFloat16,
              "x must be bfloat16 [rows, ", k, "]");
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  return llmaccel::gemm_in_row_chunks(x, n, [&](const uint32_t* pairs, int64_t rows, at::BFloat16* y, int64_t c0,
                                                int64_t c1) {
    llmaccel::bf16_gemm_columns(pairs, rows, wp, k, y, n, c0, c1);
  });
}
