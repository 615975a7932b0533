// Paged attention for decode (one query token per sequence) on the CPU.
//
// Reads keys and values straight from the block-structured KV pool through each sequence's block
// table, so nothing is gathered or copied. One work item is (sequence, kv head): the G query heads
// that share a kv head are scored together, so each key and value row is loaded once. Softmax is
// computed online (running max and sum), one pass over the context. Threads come from ATen's own
// pool (at::parallel_for), so the kernel never competes with a second OpenMP runtime.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

template <typename scalar_t>
static void decode_kernel(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache,
                          const int32_t* block_tables, const int32_t* context_lens, scalar_t* out,
                          int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(group * head_dim), qf(group * head_dim), row_max(group), row_sum(group), score(group);
    for (int64_t work = begin; work < end; ++work) {
      const int64_t seq = work / num_kv_heads, kv_head = work % num_kv_heads;
      const int64_t len = context_lens[seq];
      const int32_t* table = block_tables + seq * max_blocks;
      const scalar_t* q_seq = q + (seq * num_heads + kv_head * group) * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) qf[i] = static_cast<float>(q_seq[i]) * scale;
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(row_max.begin(), row_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(row_sum.begin(), row_sum.end(), 0.0f);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t slot = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
        const scalar_t* k_row = k_cache + (slot * num_kv_heads + kv_head) * head_dim;
        const scalar_t* v_row = v_cache + (slot * num_kv_heads + kv_head) * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float dot = 0.0f;
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * static_cast<float>(k_row[d]);
          score[g] = dot;
        }
        for (int64_t g = 0; g < group; ++g) {
          float* acc_g = acc.data() + g * head_dim;
          float weight;
          if (score[g] > row_max[g]) {
            const float rescale = std::exp(row_max[g] - score[g]);
            row_sum[g] = row_sum[g] * rescale + 1.0f;
            for (int64_t d = 0; d < head_dim; ++d) acc_g[d] *= rescale;
            row_max[g] = score[g];
            weight = 1.0f;
          } else {
            weight = std::exp(score[g] - row_max[g]);
            row_sum[g] += weight;
          }
          for (int64_t d = 0; d < head_dim; ++d) acc_g[d] += weight * static_cast<float>(v_row[d]);
        }
      }
      scalar_t* out_seq = out + (seq * num_heads + kv_head * group) * head_dim;
      for (int64_t g = 0; g < group; ++g) {
        const float inv = row_sum[g] > 0 ? 1.0f / row_sum[g] : 0.0f;
        for (int64_t d = 0; d < head_dim; ++d)
          out_seq[g * head_dim + d] = static_cast<scalar_t>(acc[g * head_dim + d] * inv);
      }
    }
  });
}

// q: [S, H, D]; k_cache, v_cache: [num_slots, KVH, D] with slot = block * block_size + offset;
// block_tables: [S, max_blocks] int32; context_lens: [S] int32 (keys visible to each query).
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q and caches must be 3-D");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && context_lens.scalar_type() == torch::kInt32,
              "block_tables and context_lens must be int32");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>(),
                            q.size(0), q.size(1), k_cache.size(1), q.size(2), block_size, tables.size(1),
                            static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
}
