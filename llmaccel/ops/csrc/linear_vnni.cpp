// bfloat16 weights packed for AMX: y[M, N] = x[M, K] @ W[N, K]^T with W stored once as blocks of 32
// output columns, each [K / 2, 32, 2] (VNNI pairs: W[c, 2p], W[c, 2p + 1] side by side), N zero-padded.
//
// On an AMX CPU oneDNN's bfloat16 GEMM, called between the decode stack's parallel phases, reached
// ~1,000 GFLOP/s at a 64-sequence step's shapes with the weights in cache, and its per-call set-up
// sits between every phase. AMX tiles multiply 16 x 32 bf16 by 32 x 16 in one instruction, but they
// read B in this pair layout only, so the weights are packed once at load. Two kernels read it:
// - `brgemm`: torch's wrapper of oneDNN's batch-reduce GEMM micro-kernel (at::native::cpublas::brgemm,
//   the AMX tile kernel SGLang's CPU backend and inductor's templates call), a block of 32 columns by up
//   to 128 rows a call, from inside the caller's own threads;
// - `vnni_stream`: for a few rows, the same blocks streamed with vdpbf16ps (each 64-byte line of a block
//   holds 16 columns' pairs for one pair of inputs, so one broadcast of the row's pair feeds 32 products):
//   bound by the weights' read, as the plain-layout streaming kernel is.
// - `ordered_stream` and `ordered_gemm` (AVX512-BF16, no AMX needed): a few rows streamed, and the bf16 GEMM
//   of gemm_bf16.cpp reading this layout, both summing in that GEMM's order, so a row gets the same bits at
//   any row count (--batch-invariant).
// The plain layout's kernels (linear_bf16.cpp, gemm_bf16.cpp, oneDNN) are not given this layout; the
// model holds one copy in one layout (ops/kernel_choice.py picks the layout and each bucket's kernel).
#include "aten.h"
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace llmaccel {

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
namespace {

// 16 float32 sums rounded to bfloat16 (to nearest even, as c10 rounds) into `count` <= 16 outputs.
inline void store_rounded(bf16* out, __m512 sums, int64_t count) {
  const __mmask16 mask = count >= 16 ? __mmask16(0xffff) : __mmask16((1u << count) - 1);
  _mm256_mask_storeu_epi16(out, mask, (__m256i)_mm512_cvtneps_pbh(sums));
}

// Columns [c, c + width) (width <= 32, one block) of G rows i0.. against the block `b` [K / 2, 32, 2].
// Four accumulators a row (even and odd pairs apart, so two dependency chains of vdpbf16ps run per
// 16 columns), summed once at the end: every G gives a row the same result.
template <int G>
inline void stream_block(const uint16_t* xb, int64_t ldx, int64_t i0, const uint16_t* b, int64_t k, bf16* y,
                         int64_t ldy, int64_t c, int64_t width) {
  __m512 acc[G][4];
  for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = _mm512_setzero_ps();
  const int64_t pairs = k / 2;
  int64_t p = 0;
  for (; p + 2 <= pairs; p += 2) {
    const uint16_t* line = b + p * 2 * kVnniBlock;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(line), w1 = (__m512bh)_mm512_loadu_si512(line + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(line + 64), w3 = (__m512bh)_mm512_loadu_si512(line + 96);
    for (int g = 0; g < G; ++g) {
      const int32_t* xr = reinterpret_cast<const int32_t*>(xb + (i0 + g) * ldx) + p;
      const __m512bh x0 = (__m512bh)_mm512_set1_epi32(xr[0]), x1 = (__m512bh)_mm512_set1_epi32(xr[1]);
      acc[g][0] = _mm512_dpbf16_ps(acc[g][0], x0, w0);
      acc[g][1] = _mm512_dpbf16_ps(acc[g][1], x0, w1);
      acc[g][2] = _mm512_dpbf16_ps(acc[g][2], x1, w2);
      acc[g][3] = _mm512_dpbf16_ps(acc[g][3], x1, w3);
    }
  }
  if (p < pairs) {  // an odd number of pairs: the last goes to the even accumulators
    const uint16_t* line = b + p * 2 * kVnniBlock;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(line), w1 = (__m512bh)_mm512_loadu_si512(line + 32);
    for (int g = 0; g < G; ++g) {
      const int32_t* xr = reinterpret_cast<const int32_t*>(xb + (i0 + g) * ldx) + p;
      const __m512bh x0 = (__m512bh)_mm512_set1_epi32(xr[0]);
      acc[g][0] = _mm512_dpbf16_ps(acc[g][0], x0, w0);
      acc[g][1] = _mm512_dpbf16_ps(acc[g][1], x0, w1);
    }
  }
  for (int g = 0; g < G; ++g) {
    bf16* out = y + (i0 + g) * ldy + c;
    store_rounded(out, _mm512_add_ps(acc[g][0], acc[g][2]), std::min<int64_t>(width, 16));
    if (width > 16) store_rounded(out + 16, _mm512_add_ps(acc[g][1], acc[g][3]), width - 16);
  }
}

// The GEMM's order for G rows (gemm_bf16.cpp): each of a block's 32 columns is one lane of two accumulators,
// summing the row's pairs p = 0, 1, ... in one chain (vdpbf16ps of the broadcast pair against the block's line
// for p, the products the GEMM forms with the operands swapped), then rounded once: a row's bits are the GEMM's
// at any row count. One chain a column is latency-bound: a row or two take B blocks side by side (B * 2
// chains a row).
template <int G, int B>
inline void ordered_block(const uint16_t* xb, int64_t ldx, int64_t i0, const uint16_t* b, int64_t k, bf16* y,
                          int64_t ldy, int64_t c, int64_t width) {
  __m512 acc[G][2 * B];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 2 * B; ++j) acc[g][j] = _mm512_setzero_ps();
  const int32_t* xr[G];
  for (int g = 0; g < G; ++g) xr[g] = reinterpret_cast<const int32_t*>(xb + (i0 + g) * ldx);
  const int64_t pairs = k / 2, block = k * kVnniBlock;  // (a block's length in bf16)
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh w[2 * B];
    for (int j = 0; j < B; ++j) {
      const uint16_t* line = b + j * block + p * 2 * kVnniBlock;
      w[2 * j] = (__m512bh)_mm512_loadu_si512(line);
      w[2 * j + 1] = (__m512bh)_mm512_loadu_si512(line + 32);
    }
    for (int g = 0; g < G; ++g) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(xr[g][p]);
      for (int j = 0; j < 2 * B; ++j) acc[g][j] = _mm512_dpbf16_ps(acc[g][j], x, w[j]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < B; ++j) {
      bf16* out = y + (i0 + g) * ldy + c + j * kVnniBlock;
      const int64_t cols = std::min<int64_t>(kVnniBlock, width - j * kVnniBlock);
      store_rounded(out, acc[g][2 * j], std::min<int64_t>(cols, 16));
      if (cols > 16) store_rounded(out + 16, acc[g][2 * j + 1], cols - 16);
    }
}

}  // namespace

bool vnni_compiled() { return at::native::cpublas::could_pack(at::kBFloat16); }

LLMACCEL_ONE_COPY void vnni_ordered_columns(const uint16_t* xb, int64_t ldx, int64_t m, int64_t k,
                                            const uint16_t* packed, bf16* y, int64_t ldy, int64_t c0, int64_t c1) {
  int64_t c = c0;
  if (m <= 2)  // a lone row's two chains a block wait on each other: two blocks at once
    for (; c + 2 * kVnniBlock <= c1; c += 2 * kVnniBlock) {
      const uint16_t* b = packed + c / kVnniBlock * (k * kVnniBlock);
      if (m == 1)
        ordered_block<1, 2>(xb, ldx, 0, b, k, y, ldy, c, 2 * kVnniBlock);
      else
        ordered_block<2, 2>(xb, ldx, 0, b, k, y, ldy, c, 2 * kVnniBlock);
    }
  for (; c < c1; c += kVnniBlock) {
    const uint16_t* b = packed + c / kVnniBlock * (k * kVnniBlock);
    const int64_t width = std::min<int64_t>(kVnniBlock, c1 - c);
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) ordered_block<4, 1>(xb, ldx, i, b, k, y, ldy, c, width);
    switch (m - i) {
      case 3: ordered_block<3, 1>(xb, ldx, i, b, k, y, ldy, c, width); break;
      case 2: ordered_block<2, 1>(xb, ldx, i, b, k, y, ldy, c, width); break;
      case 1: ordered_block<1, 1>(xb, ldx, i, b, k, y, ldy, c, width); break;
      default: break;
    }
  }
}

LLMACCEL_ONE_COPY void vnni_stream_columns(const uint16_t* xb, int64_t ldx, int64_t m, int64_t k,
                                           const uint16_t* packed, bf16* y, int64_t ldy, int64_t c0, int64_t c1) {
  for (int64_t c = c0; c < c1; c += kVnniBlock) {
    const uint16_t* b = packed + c / kVnniBlock * (k * kVnniBlock);
    const int64_t width = std::min<int64_t>(kVnniBlock, c1 - c);
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) stream_block<4>(xb, ldx, i, b, k, y, ldy, c, width);
    switch (m - i) {
      case 3: stream_block<3>(xb, ldx, i, b, k, y, ldy, c, width); break;
      case 2: stream_block<2>(xb, ldx, i, b, k, y, ldy, c, width); break;
      case 1: stream_block<1>(xb, ldx, i, b, k, y, ldy, c, width); break;
      default: break;
    }
  }
}

// Up to 128 rows a brgemm call (the micro-kernel walks them 32 at a time against a block's B tiles; a
// call of 32 rows cost 1.3x as much at 64 rows, measured on a 2-core Xeon). The float32 sums land in a
// tile-sized buffer and are rounded into y from L1 (a sums array of the whole output rounded afterwards
// made the LM head at 256 rows 3.8x slower: 50 MB more traffic).
static void brgemm_rows(const uint16_t* xb, int64_t ldx, int64_t r0, int64_t r1, const uint16_t* block, int64_t k,
                        int64_t width, bf16* y, int64_t ldy, int64_t c) {
  constexpr int64_t kCallRows = 128;
  alignas(64) float sums[kCallRows * kVnniBlock];
  const auto* a = reinterpret_cast<const at::BFloat16*>(xb);
  const auto* b = reinterpret_cast<const at::BFloat16*>(block);
  for (int64_t i = r0; i < r1; i += kCallRows) {
    const int64_t rows = std::min(kCallRows, r1 - i);
    at::native::cpublas::brgemm(rows, width, k, ldx, kVnniBlock, kVnniBlock, false, a + i * ldx, b, sums);
    for (int64_t r = 0; r < rows; ++r) {
      bf16* out = y + (i + r) * ldy + c;
      store_rounded(out, _mm512_loadu_ps(sums + r * kVnniBlock), std::min<int64_t>(width, 16));
      if (width > 16) store_rounded(out + 16, _mm512_loadu_ps(sums + r * kVnniBlock + 16), width - 16);
    }
  }
}

LLMACCEL_ONE_COPY void vnni_brgemm_columns(const uint16_t* xb, int64_t ldx, int64_t m, int64_t k,
                                           const uint16_t* packed, bf16* y, int64_t ldy, int64_t c0, int64_t c1) {
  for (int64_t r0 = 0; r0 < m; r0 += kBrgemmChunkRows) {
    const int64_t r1 = std::min(m, r0 + kBrgemmChunkRows);
    for (int64_t c = c0; c < c1; c += kVnniBlock)
      brgemm_rows(xb, ldx, r0, r1, packed + c / kVnniBlock * (k * kVnniBlock), k, std::min<int64_t>(kVnniBlock, c1 - c),
                  y, ldy, c);
  }
}

void vnni_release() { at::native::cpublas::brgemm_release(); }

#else
bool vnni_compiled() { return false; }

void vnni_stream_columns(const uint16_t*, int64_t, int64_t, int64_t, const uint16_t*, bf16*, int64_t, int64_t,
                         int64_t) {
  TORCH_CHECK(false, "the packed bfloat16 kernels need AVX512-BF16");
}

void vnni_brgemm_columns(const uint16_t*, int64_t, int64_t, int64_t, const uint16_t*, bf16*, int64_t, int64_t,
                         int64_t) {
  TORCH_CHECK(false, "the packed bfloat16 kernels need AVX512-BF16");
}

void vnni_release() {}

void vnni_ordered_columns(const uint16_t*, int64_t, int64_t, int64_t, const uint16_t*, bf16*, int64_t, int64_t,
                          int64_t) {
  TORCH_CHECK(false, "the ordered bfloat16 kernels need AVX512-BF16");
}
#endif

void check_vnni(const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kVnniBlock && packed.size(3) == 2 &&
                  packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous(),
              "packed weights must be contiguous bfloat16 [ceil(N / 32), K / 2, 32, 2]");
  TORCH_CHECK(n > (packed.size(0) - 1) * kVnniBlock && n <= packed.size(0) * kVnniBlock,
              "n = ", n, " does not fit ", packed.size(0), " blocks of 32 columns");
}

}  // namespace llmaccel

bool vnni_available() { return llmaccel::vnni_compiled(); }

// w bfloat16 [N, K] (K even) -> [ceil(N / 32), K / 2, 32, 2], the padding columns zero.
torch::Tensor pack_vnni(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous(),
              "w must be contiguous bfloat16 [N, K]");
  const int64_t n = w.size(0), k = w.size(1), blocks = (n + llmaccel::kVnniBlock - 1) / llmaccel::kVnniBlock;
  TORCH_CHECK(k % 2 == 0, "K must be even, got ", k);
  auto out = torch::zeros({blocks, k / 2, llmaccel::kVnniBlock, 2}, w.options());
  const auto* src = reinterpret_cast<const uint32_t*>(w.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint32_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t c = 0; c < llmaccel::kVnniBlock && b * llmaccel::kVnniBlock + c < n; ++c) {
        const uint32_t* row = src + (b * llmaccel::kVnniBlock + c) * (k / 2);
        for (int64_t p = 0; p < k / 2; ++p) dst[(b * (k / 2) + p) * llmaccel::kVnniBlock + c] = row[p];
      }
  });
  return out;
}

// x bfloat16 [M, K] against packed weights of n outputs -> bfloat16 [M, n] (float32 sums rounded once),
// by `kernel`: vnni_stream, brgemm or ordered_stream, the columns split between the threads a block at a time,
// or ordered_gemm, the rows packed in pairs as for the plain GEMM.
torch::Tensor linear_vnni(torch::Tensor x, torch::Tensor packed, int64_t n, const std::string& kernel) {
  llmaccel::check_vnni(packed, n);
  const int64_t k = packed.size(1) * 2;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.scalar_type() == torch::kBFloat16,
              "x must be bfloat16 [rows, ", k, "]");
  TORCH_CHECK(kernel == "vnni_stream" || kernel == "brgemm" || kernel == "ordered_stream" || kernel == "ordered_gemm",
              "unknown packed kernel '", kernel, "' (vnni_stream, brgemm, ordered_stream or ordered_gemm)");
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const bool needs_amx = kernel == "vnni_stream" || kernel == "brgemm";
  TORCH_CHECK(!needs_amx || llmaccel::vnni_compiled(), "the packed bfloat16 kernels are not available on this CPU");
  TORCH_CHECK(needs_amx || llmaccel::bf16_gemm_compiled(), "the ordered bfloat16 kernels need AVX512-BF16");
  if (kernel == "ordered_gemm")
    return llmaccel::gemm_in_row_chunks(x, n, [&](const uint32_t* pairs, int64_t rows, at::BFloat16* y, int64_t c0,
                                                  int64_t c1) {
      llmaccel::bf16_gemm_vnni_columns(pairs, rows, wp, k, y, n, c0, c1);
    });
  const bool brgemm = kernel == "brgemm", ordered = kernel == "ordered_stream";
  auto xc = x.contiguous();
  const int64_t m = xc.size(0);
  auto y = torch::empty({m, n}, xc.options());
  if (m == 0) return y;
  const auto* xb = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  auto* yp = y.data_ptr<at::BFloat16>();
  const int64_t blocks = packed.size(0);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    const int64_t c0 = b0 * llmaccel::kVnniBlock, c1 = std::min(n, b1 * llmaccel::kVnniBlock);
    if (brgemm) {
      llmaccel::vnni_brgemm_columns(xb, k, m, k, wp, yp, n, c0, c1);
      llmaccel::vnni_release();
    } else if (ordered) {
      llmaccel::vnni_ordered_columns(xb, k, m, k, wp, yp, n, c0, c1);
    } else {
      llmaccel::vnni_stream_columns(xb, k, m, k, wp, yp, n, c0, c1);
    }
  });
  return y;
}
