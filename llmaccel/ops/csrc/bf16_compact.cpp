// bfloat16 weights held losslessly in 12 bits a weight: the "compact" layout.
//
// A lone decode step reads every weight once, so its time is the weights' bytes over the memory's
// bandwidth, and a bfloat16 model reads 2 bytes a weight. Those 16 bits are not 16 bits of information:
// the high byte (sign and the exponent's top seven bits) of a trained or randomly initialised weight
// takes a handful of values (the 1B random-weight shape: 16 of them cover 99.99% of the weights), while
// the low byte (the exponent's last bit and the 7-bit mantissa) is noise. So each block of 64 weights
// is stored as 64 low bytes and 64 four-bit codes for the high bytes (96 bytes, 0.75 of 128), the codes
// standing for the tensor's 16 most frequent high bytes. A block holding any other high byte is kept
// whole (128 bytes) in a side array, flagged in a bitmap per row: ~0.5% of blocks, in order, so a row
// still reads front to back. Nothing is rounded: every weight decodes to its own bits.
//
// The decode is four instructions for 64 weights (zero-extend the codes, shift and mask them into bytes,
// vpshufb them through the 16-entry table, interleave with the low bytes), so the kernels below stay
// bound by the memory: measured on a 2-core AMD EPYC Zen 4, a 1B model's worth of projections at one
// row in 46 ms against 61 ms for the plain layout (both ~35 GB/s). The block's bytes are stored in
// the order the interleave reads them, so the two registers a block decodes to are the plain layout's
// two loads of it, and the streaming and GEMM kernels here give the plain ones' results to the bit.
//
// One uint8 tensor holds it all: a header, the rows' blocks (K / 64 x 96 bytes a row), the bitmap
// (K / 64 bits a row, in 64-bit words), each row's first whole block's index, the whole blocks.
#include "aten.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "kernels.h"

namespace llmaccel {
namespace {

constexpr uint64_t kMagic = 0x32316662'63637561ULL;  // "auccbf12"
constexpr int64_t kHeaderBytes = 128;

struct Header {
  uint64_t magic;
  int64_t n, k, words, whole_blocks;
  int64_t bitmap_at, index_at, whole_at;  // byte offsets of the sections
  uint8_t high[16];                       // the high byte each code stands for
};
static_assert(sizeof(Header) <= kHeaderBytes, "the header must fit its bytes");

int64_t align64(int64_t bytes) { return (bytes + 63) / 64 * 64; }

// Where weight j (0 .. 63) of a block sits among its 64 slots: vpunpcklbw / vpunpckhbw interleave the
// low 8 and the high 8 bytes of each 128-bit lane, so weights 0-31 are slots 0-7, 16-23, 32-39, 48-55
// and weights 32-63 the other halves of the lanes.
int slot_of(int j) {
  const int q = j & 31;
  return 16 * (q / 8) + (j >= 32 ? 8 : 0) + q % 8;
}

uint8_t code_nibble(const uint8_t* codes, int slot) {
  return slot % 2 == 0 ? codes[slot / 2] & 0x0f : codes[slot / 2] >> 4;
}

}  // namespace

CompactView compact_view(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kByte && t.is_contiguous() && t.dim() == 1 && t.numel() >= kHeaderBytes,
              "a compact bf16 weight is a contiguous uint8 tensor made by pack_bf16_compact");
  Header h;
  std::memcpy(&h, t.data_ptr<uint8_t>(), sizeof(h));
  TORCH_CHECK(h.magic == kMagic, "not a compact bf16 weight (pack_bf16_compact makes them)");
  TORCH_CHECK(h.k > 0 && h.k % kCompactBlock == 0 && h.n > 0 && h.words == (h.k / kCompactBlock + 63) / 64 &&
                  h.whole_at + h.whole_blocks * kCompactBlock * 2 <= t.numel(),
              "a compact bf16 weight's header does not match its size");
  const uint8_t* base = t.data_ptr<uint8_t>();
  CompactView v;
  v.blocks = base + kHeaderBytes;
  v.bitmap = reinterpret_cast<const uint64_t*>(base + h.bitmap_at);
  v.first_whole = reinterpret_cast<const int64_t*>(base + h.index_at);
  v.whole = reinterpret_cast<const uint16_t*>(base + h.whole_at);
  v.n = h.n;
  v.k = h.k;
  v.words = h.words;
  std::memcpy(v.high, h.high, sizeof(v.high));
  return v;
}

// Rows [r0, r1) in the plain layout (bits), into out [r1 - r0, K].
void compact_unpack_rows(const CompactView& w, int64_t r0, int64_t r1, uint16_t* out) {
  const int64_t per_row = w.k / kCompactBlock;
#if defined(__AVX512BW__)
  const __m512i table = compact_table(w);
#endif
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* block = w.blocks + r * per_row * kCompactBytes;
    const uint16_t* whole = w.whole + w.first_whole[r] * kCompactBlock;
    uint16_t* row = out + (r - r0) * w.k;
    const bool any_whole = compact_row_has_whole(w, r);
    for (int64_t b = 0; b < per_row; ++b, block += kCompactBytes, row += kCompactBlock) {
      if (any_whole && compact_is_whole(w, r, b)) {
        std::memcpy(row, whole, kCompactBlock * 2);
        whole += kCompactBlock;
        continue;
      }
#if defined(__AVX512BW__)
      __m512i w0, w1;
      compact_decode(block, table, w0, w1);
      _mm512_storeu_si512(row, w0);
      _mm512_storeu_si512(row + 32, w1);
#else
      for (int j = 0; j < kCompactBlock; ++j) {
        const int slot = slot_of(j);
        row[j] = static_cast<uint16_t>(w.high[code_nibble(block, slot)] << 8 | block[32 + slot]);
      }
#endif
    }
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
namespace {

// Weight row r against activation rows i0 .. i0 + G - 1: bf16_dot_group's sums (linear_bf16.cpp), block
// by block in the same order, each block decoded once for the G rows.
template <int G>
void compact_dot_group(const uint16_t* xb, const CompactView& w, __m512i table, float* y, int64_t ldy, int64_t i0,
                       int64_t r) {
  const int64_t per_row = w.k / kCompactBlock;
  const uint8_t* block = w.blocks + r * per_row * kCompactBytes;
  const uint16_t* whole = w.whole + w.first_whole[r] * kCompactBlock;
  const bool any_whole = compact_row_has_whole(w, r);
  __m512 c[G][2];
  for (int g = 0; g < G; ++g) c[g][0] = c[g][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < per_row; ++b, block += kCompactBytes) {
    // the weights 40 KB ahead, as bf16_dot_group does from 2 rows (linear_bf16.cpp), and here at one row too: an 8B
    // down projection (K = 14,336) read 30 GB/s without it and 42 with it, the others 1.0-1.06x (2-core Zen 5)
    prefetch_ahead(block, 128);
    __m512i w0, w1;
    if (any_whole && compact_is_whole(w, r, b)) {
      w0 = _mm512_loadu_si512(whole);
      w1 = _mm512_loadu_si512(whole + 32);
      whole += kCompactBlock;
    } else {
      compact_decode(block, table, w0, w1);
    }
    for (int g = 0; g < G; ++g) {
      const uint16_t* xr = xb + (i0 + g) * w.k + b * kCompactBlock;
      c[g][0] = _mm512_dpbf16_ps(c[g][0], (__m512bh)_mm512_loadu_si512(xr), (__m512bh)w0);
      c[g][1] = _mm512_dpbf16_ps(c[g][1], (__m512bh)_mm512_loadu_si512(xr + 32), (__m512bh)w1);
    }
  }
  for (int g = 0; g < G; ++g) y[(i0 + g) * ldy + r] = _mm512_reduce_add_ps(_mm512_add_ps(c[g][0], c[g][1]));
}

}  // namespace

bool compact_compiled() { return true; }

LLMACCEL_ONE_COPY void compact_columns(const uint16_t* xb, const CompactView& w, float* y, int64_t ldy, int64_t m,
                                       int64_t n0, int64_t n1) {
  const __m512i table = compact_table(w);
  for (int64_t r = n0; r < n1; ++r)
    in_groups_of<kDotRows>(m, [&](auto g, int64_t i) { compact_dot_group<decltype(g)::value>(xb, w, table, y, ldy, i, r); });
}

// The GEMM (gemm_bf16.cpp) on one tile's columns of weight rows at a time (gemm_tile_cols: 4 or 8), each group
// decoded into a buffer that stays in L1 while the rows' tiles read it: the same sums as on the plain layout, at the
// cost of one decode a weight a call (a 64-row batch does 2 x 64 multiply-adds a weight).
LLMACCEL_ONE_COPY void compact_gemm_columns(const uint32_t* packed, int64_t m, const CompactView& w, bf16* y,
                                            int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t group = gemm_tile_cols(m);  // 16-32 KB decoded at K = 2,048
  thread_local std::vector<uint16_t> rows;
  rows.resize(group * w.k);
  const int64_t row_bytes = w.k / kCompactBlock * kCompactBytes;
  for (int64_t c = n0; c < n1; c += group) {
    const int64_t count = std::min(group, n1 - c);
    compact_unpack_rows(w, c, c + count, rows.data());
    // the next group's blocks come into L2 while this one's tiles run (decoding reads them then, not memory)
    const int64_t next = std::min(group, n1 - c - count);
    bf16_gemm_columns(packed, m, rows.data(), w.k, y + c, ldy, 0, count, w.blocks + (c + count) * row_bytes,
                      next * row_bytes);
  }
}

#else
bool compact_compiled() { return false; }

void compact_columns(const uint16_t*, const CompactView&, float*, int64_t, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "the compact bf16 kernels need AVX512-BF16");
}

void compact_gemm_columns(const uint32_t*, int64_t, const CompactView&, bf16*, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "the compact bf16 kernels need AVX512-BF16");
}
#endif

}  // namespace llmaccel

namespace {

using llmaccel::Header;
using llmaccel::kCompactBlock;
using llmaccel::kCompactBytes;

// The 16 most frequent high bytes of rows 0, stride, 2 stride, ... of w [n, k] (ties to the smaller byte),
// counted in parallel. Four tables a thread, taken in turn: a weight's high byte mostly repeats its neighbour's,
// and one table's increments of the same count wait on each other.
std::array<uint8_t, 16> frequent_high_bytes(const uint16_t* w, int64_t n, int64_t k, int64_t stride) {
  const int threads = at::get_num_threads();
  std::vector<std::array<int64_t, 256>> counts(threads);
  for (auto& c : counts) c.fill(0);
  at::parallel_for(0, (n + stride - 1) / stride, std::max<int64_t>(1, (1 << 20) / k), [&](int64_t a, int64_t b) {
    std::array<std::array<int64_t, 256>, 4> t{};
    for (int64_t row = a; row < b; ++row) {
      const uint16_t* x = w + row * stride * k;
      for (int64_t i = 0; i + 4 <= k; i += 4) {  // k is a multiple of 64
        ++t[0][x[i] >> 8];
        ++t[1][x[i + 1] >> 8];
        ++t[2][x[i + 2] >> 8];
        ++t[3][x[i + 3] >> 8];
      }
    }
    auto& c = counts[at::get_thread_num()];
    for (int v = 0; v < 256; ++v) c[v] += t[0][v] + t[1][v] + t[2][v] + t[3][v];
  });
  std::array<int64_t, 256> total{};
  for (const auto& c : counts)
    for (int v = 0; v < 256; ++v) total[v] += c[v];
  std::array<int, 256> order;
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return total[a] > total[b]; });
  std::array<uint8_t, 16> high;
  for (int i = 0; i < 16; ++i) high[i] = static_cast<uint8_t>(order[i]);
  return high;
}

// Codes a block of 64 weights against the 16 high bytes: whether one of its high bytes has no code, and its 96
// bytes where all have (the 32 code bytes, two slots' nibbles a byte, then the 64 low bytes in slot order).
// With AVX512-BW a block is two registers and the codes 16 byte compares: packus of a lane's words puts their
// bytes in slot order (slot s holds weight 8 * (s / 16) + s % 8 + 32 * (s % 16 / 8), llmaccel::slot_of); the
// scalar form looks each byte up and runs at ~1 GB/s a core, a third of the time an 8B model's load spent
// outside the disk.
class BlockCoder {
 public:
  explicit BlockCoder(const std::array<uint8_t, 16>& high) : high_(high) {
    code_.fill(0);
    uncoded_.fill(1);
    for (int i = 0; i < 16; ++i) {
      code_[high[i]] = static_cast<uint8_t>(i);
      uncoded_[high[i]] = 0;
    }
  }

#if defined(__AVX512BW__)
  bool uncoded(const uint16_t* src) const {
    __m512i codes;
    return coded(slot_bytes(src, 8), codes) != ~__mmask64{0};
  }

  void pack(const uint16_t* src, uint8_t* block) const {
    __m512i codes;
    coded(slot_bytes(src, 8), codes);
    const __m512i pairs = _mm512_or_si512(codes, _mm512_srli_epi16(codes, 4));  // low byte: code[2m] | code[2m+1] << 4
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(block), _mm512_cvtepi16_epi8(pairs));
    _mm512_storeu_si512(block + 32, slot_bytes(src, 0));
  }

 private:
  // the 64 weights' low (shift 0) or high (shift 8) bytes in slot order
  static __m512i slot_bytes(const uint16_t* src, int shift) {
    const __m512i mask = _mm512_set1_epi16(0xff);
    const __m512i a = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(src), shift), mask);
    const __m512i b = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(src + 32), shift), mask);
    return _mm512_packus_epi16(a, b);
  }

  // each high byte's code (0 where it has none) and the mask of those that have one
  __mmask64 coded(__m512i highs, __m512i& codes) const {
    codes = _mm512_setzero_si512();
    __mmask64 found = 0;
    for (int i = 0; i < 16; ++i) {
      const __mmask64 hit = _mm512_cmpeq_epi8_mask(highs, _mm512_set1_epi8(static_cast<char>(high_[i])));
      codes = _mm512_mask_mov_epi8(codes, hit, _mm512_set1_epi8(static_cast<char>(i)));
      found |= hit;
    }
    return found;
  }
#else
  bool uncoded(const uint16_t* src) const {
    unsigned any = 0;
    for (int j = 0; j < kCompactBlock; ++j) any |= uncoded_[src[j] >> 8];
    return any != 0;
  }

  void pack(const uint16_t* src, uint8_t* block) const {
    for (int run = 0; run < 8; ++run) {  // slots 8 run .. 8 run + 7: eight consecutive weights
      const uint16_t* in = src + 8 * (run / 2) + 32 * (run % 2);
      for (int t = 0; t < 8; ++t) block[32 + 8 * run + t] = static_cast<uint8_t>(in[t] & 0xff);
      for (int t = 0; t < 8; t += 2)
        block[(8 * run + t) / 2] = static_cast<uint8_t>(code_[in[t] >> 8] | code_[in[t + 1] >> 8] << 4);
    }
  }

 private:
#endif
  std::array<uint8_t, 16> high_;
  std::array<uint8_t, 256> code_, uncoded_;
};

}  // namespace

bool bf16_compact_available() { return llmaccel::compact_compiled(); }

// w bfloat16 [N, K] (K a multiple of 64) -> the compact layout (one uint8 tensor): written at the front of `into`
// where given and it fits (its first bytes, returned; a weight arena's free bytes, so it is made where it will be
// streamed from), else into a tensor of its own.
torch::Tensor pack_bf16_compact(torch::Tensor w, c10::optional<torch::Tensor> into) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous() && w.numel() > 0,
              "w must be a contiguous, non-empty bfloat16 [N, K]");
  const int64_t n = w.size(0), k = w.size(1), per_row = k / kCompactBlock;
  TORCH_CHECK(k % kCompactBlock == 0, "the compact layout needs K a multiple of 64, got ", k);
  const auto* bits = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  Header h{};
  h.magic = llmaccel::kMagic;
  h.n = n;
  h.k = k;
  h.words = (per_row + 63) / 64;
  // The codes' table only decides which blocks stay whole, never a weight's bits: counted on ~1M weights of
  // evenly spaced rows (every row of a small weight), where the whole weight took 40% of an 8B model's packing.
  const auto high = frequent_high_bytes(bits, n, k, std::max<int64_t>(1, n * k / (1 << 20)));
  std::memcpy(h.high, high.data(), 16);
  const BlockCoder coder(high);
  // each row's whole blocks, counted, then numbered in row order
  std::vector<int64_t> first(n + 1, 0);
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < per_row; ++b) first[r + 1] += coder.uncoded(bits + r * k + b * kCompactBlock);
  });
  std::partial_sum(first.begin(), first.end(), first.begin());
  h.whole_blocks = first[n];
  const int64_t blocks_end = llmaccel::kHeaderBytes + n * per_row * kCompactBytes;
  h.bitmap_at = llmaccel::align64(blocks_end);
  h.index_at = llmaccel::align64(h.bitmap_at + n * h.words * 8);
  h.whole_at = llmaccel::align64(h.index_at + (n + 1) * 8);
  // every byte written below, none twice: the blocks' 96 bytes each (a whole block's zeroed), the rest here
  const int64_t total = h.whole_at + h.whole_blocks * kCompactBlock * 2;
  if (into.has_value())
    TORCH_CHECK(into->scalar_type() == torch::kUInt8 && into->dim() == 1 && into->is_contiguous(),
                "into must be a contiguous uint8 tensor, got ", into->sizes());
  const bool fits = into.has_value() && into->numel() >= total;  // else (too many whole blocks) a tensor of its own
  auto out = fits ? into->narrow(0, 0, total) : torch::empty({total}, torch::dtype(torch::kUInt8));
  uint8_t* base = out.data_ptr<uint8_t>();
  std::memset(base, 0, llmaccel::kHeaderBytes);
  std::memcpy(base, &h, sizeof(h));
  std::memset(base + blocks_end, 0, h.index_at - blocks_end);  // the alignment padding and the bitmap
  std::memcpy(base + h.index_at, first.data(), (n + 1) * 8);
  std::memset(base + h.index_at + (n + 1) * 8, 0, h.whole_at - h.index_at - (n + 1) * 8);
  auto* bitmap = reinterpret_cast<uint64_t*>(base + h.bitmap_at);
  auto* whole = reinterpret_cast<uint16_t*>(base + h.whole_at);
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      uint16_t* whole_row = whole + first[r] * kCompactBlock;
      const bool any_whole = first[r + 1] > first[r];
      for (int64_t b = 0; b < per_row; ++b) {
        const uint16_t* src = bits + r * k + b * kCompactBlock;
        uint8_t* block = base + llmaccel::kHeaderBytes + (r * per_row + b) * kCompactBytes;
        if (any_whole && coder.uncoded(src)) {
          bitmap[r * h.words + b / 64] |= uint64_t{1} << (b % 64);
          std::memcpy(whole_row, src, kCompactBlock * 2);
          whole_row += kCompactBlock;
          std::memset(block, 0, kCompactBytes);
          continue;
        }
        coder.pack(src, block);
      }
    }
  });
  return out;
}

// The plain layout of a compact weight, rows `ids` (any shape) or every row: bfloat16 [*ids.shape, K].
torch::Tensor unpack_bf16_compact(torch::Tensor packed, c10::optional<torch::Tensor> ids) {
  const auto w = llmaccel::compact_view(packed);
  const auto rows = ids ? ids->to(torch::kInt64).contiguous() : torch::Tensor();
  const int64_t count = ids ? rows.numel() : w.n;
  const int64_t* row_ids = ids ? rows.data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; ids && i < count; ++i)
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < w.n, "row ", row_ids[i], " is outside the weight's ", w.n, " rows");
  auto out = torch::empty({count, w.k}, torch::dtype(torch::kBFloat16));
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, count, 16, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      const int64_t r = row_ids ? row_ids[i] : i;
      llmaccel::compact_unpack_rows(w, r, r + 1, dst + i * w.k);
    }
  });
  if (!ids) return out;
  std::vector<int64_t> shape(ids->sizes().begin(), ids->sizes().end());
  shape.push_back(w.k);
  return out.view(shape);
}


// x [M, K] bfloat16 against a compact weight: float32 sums [M, N] (the streaming kernel; gemv_bf16's on the plain
// layout, to the bit), or with `gemm` bfloat16 [M, N] (gemm_bf16's, to the bit).
torch::Tensor linear_bf16_compact(torch::Tensor x, torch::Tensor packed, bool gemm) {
  TORCH_CHECK(llmaccel::compact_compiled(), "the compact bf16 kernels were not compiled (they need AVX512-BF16)");
  const auto w = llmaccel::compact_view(packed);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.k && x.scalar_type() == torch::kBFloat16,
              "x must be bfloat16 [rows, ", w.k, "]");
  auto xc = x.contiguous();
  const int64_t m = xc.size(0);
  const int64_t threads = at::get_num_threads();
  if (!gemm) {
    auto y = torch::empty({m, w.n}, xc.options().dtype(torch::kFloat32));
    const auto* xb = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
    const int64_t grain = std::max<int64_t>(16, (w.n + threads - 1) / threads + 3) / 4 * 4;
    at::parallel_for(0, w.n, grain, [&](int64_t n0, int64_t n1) {
      llmaccel::compact_columns(xb, w, y.data_ptr<float>(), w.n, m, n0, n1);
    });
    return y;
  }
  if (m <= llmaccel::gemm_chunk_rows(w.k))
    return llmaccel::gemm_in_row_chunks(xc, w.n, [&](const uint32_t* pairs, int64_t rows, at::BFloat16* y, int64_t c0,
                                                     int64_t c1) {
      llmaccel::compact_gemm_columns(pairs, rows, w, y, w.n, c0, c1);
    });
  // Several chunks of rows (a prefill): a pass's weight rows decoded once, into a buffer every chunk then reads;
  // the first chunk's tiles request the next pass's rows into L2 (decoding them from memory cost 0.88x the plain
  // GEMM's speed at 96-128 rows).
  thread_local std::vector<uint16_t> decoded;
  thread_local int64_t first = 0;
  thread_local bool first_chunk = false;
  const int64_t row_bytes = w.k / kCompactBlock * kCompactBytes;
  return llmaccel::gemm_in_row_chunks(
      xc, w.n,
      [&](const uint32_t* pairs, int64_t rows, at::BFloat16* y, int64_t c0, int64_t c1) {
        const int64_t next = first_chunk ? std::min(c1 - c0, w.n - c1) : 0;
        first_chunk = false;
        llmaccel::bf16_gemm_columns(pairs, rows, decoded.data() + (c0 - first) * w.k, w.k, y + c0, w.n, 0, c1 - c0,
                                    w.blocks + c1 * row_bytes, next * row_bytes);
      },
      [&](int64_t c0, int64_t c1) {
        decoded.resize((c1 - c0) * w.k);
        llmaccel::compact_unpack_rows(w, c0, c1, decoded.data());
        first = c0;
        first_chunk = true;
      });
}
