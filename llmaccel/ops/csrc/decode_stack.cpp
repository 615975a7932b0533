// A decode step of a Llama-family decoder stack in one call: every layer's norms, projections, RoPE,
// KV write, paged attention and gated MLP, from the embedding rows to the final norm.
//
// At one row a layer of the default model moves 3.5 MB (INT8) to 14 MB (float32) of weights, 60-700 us
// of memory traffic; the Python around the kernels (module calls, views, a dozen dispatches and thread
// wake-ups a layer at 4-40 us each) cost 6-7 ms a token, a quarter of a float32 token and half of an
// INT8 one. Here the whole step runs inside one parallel region: each phase splits its work between
// the threads (output columns of a projection, rows of a norm, (sequence, KV head) items of attention)
// and a barrier ends it, so a token costs its weight traffic plus ~7 barriers a layer.
//
// The arithmetic is the kernels' own (kernels.h) in the order the layer-by-layer path runs it, so the
// two give bit-identical hidden states (tested). Only decode-only steps with float32 activations come
// here; prefill and mixed steps take the layer-by-layer path.
#include "aten.h"
#include <ATen/ops/linear.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "decode_stack.h"
#include "lora.h"
#include "kernels.h"

namespace llmaccel {

// A projection's weights in one of the kernels' layouts.
struct StackLinear {
  enum Kind { kF32Panels, kHalfPanels, kBf16, kBf16Vnni, kBf16Compact, kInt8, kInt4, kKQuant } kind;
  torch::Tensor weight, scale, bias;  // scale: INT8 row scales (undefined where the blocks hold theirs)
  int64_t n = 0, k = 0;
  int64_t kq_type = 0;  // kKQuant: the GGML type (12 Q4_K, 13 Q5_K, 14 Q6_K)
  CompactView compact;  // kBf16Compact: where its sections are
  // a projection whose parts (consecutive output columns, each a multiple of 16 but the last) are in different
  // layouts, e.g. a GGUF file's q and k in Q4_K and its v in Q6_K: each part computes its own columns
  std::vector<std::shared_ptr<StackLinear>> parts;
  std::vector<int64_t> starts;  // first output column of each part

  // integer weights: the activation rows are quantized to INT8 first
  bool quantized() const {
    if (!parts.empty())
      return std::any_of(parts.begin(), parts.end(), [](const auto& p) { return p->quantized(); });
    return kind == kInt8 || kind == kInt4 || kind == kKQuant;
  }
  // float weights, which read the rows as float32 (integer ones read them quantized)
  bool reads_floats() const {
    if (!parts.empty())
      return std::any_of(parts.begin(), parts.end(), [](const auto& p) { return p->reads_floats(); });
    return !quantized() && kind != kBf16Compact;  // (the compact kernels read the bfloat16 bits)
  }
  // INT8/INT4 blocks and K-quant records, which the AMX kernel for quantized weights also reads; a fused
  // projection where every part does and each starts on a block of 32 columns
  bool amx_readable() const {
    if (!parts.empty())
      return std::all_of(parts.begin(), parts.end(), [](const auto& p) { return p->amx_readable(); }) &&
             std::all_of(starts.begin(), starts.end(), [](int64_t start) { return start % kVnniBlock == 0; });
    return kind == kInt8 || kind == kInt4 || kind == kKQuant;
  }
  // the weights as the AMX kernel for quantized weights reads them (quant_amx.cpp; not a fused projection)
  QuantizedWeight quantized_weight() const {
    QuantizedWeight w;
    w.blocks = weight.data_ptr<uint8_t>();
    w.row_scale = scale.defined() ? scale.data_ptr<float>() : nullptr;
    w.block_stride = weight.size(2);
    w.k = k;
    w.n = n;
    w.int4 = kind == kInt4;
    w.kq_type = kind == kKQuant ? kq_type : 0;
    return w;
  }
  // output columns [c0, c1) (multiples of 32, or n) by the AMX kernel, each part its own columns
  void amx_columns(const uint16_t* xb, int64_t m, c10::BFloat16* y, int64_t ldy, int64_t c0, int64_t c1) const {
    if (parts.empty()) return amx_quant_columns(quantized_weight(), xb, k, m, y, ldy, c0, c1);
    for (size_t i = 0; i < parts.size(); ++i) {
      const int64_t start = starts[i], end = start + parts[i]->n;
      const int64_t lo = std::max(c0, start), hi = std::min(c1, end);
      if (lo < hi) parts[i]->amx_columns(xb, m, y + start, ldy, lo - start, hi - start);
    }
  }

  // Output columns [c0, c1) of x W^T in float32 for m rows (no bias); x's rows quantized in `a` when
  // the weights are integers, and as bfloat16 bits in `xb` when they are bfloat16 values (else null).
  // c0 is a multiple of 16, c1 too unless it is n.
  void columns(const float* x, const uint16_t* xb, const QuantizedRows& a, float* y, int64_t ldy, int64_t m,
               int64_t c0, int64_t c1) const {
    if (c0 >= c1) return;
    if (!parts.empty()) {
      for (size_t i = 0; i < parts.size(); ++i) {
        const int64_t start = starts[i], end = start + parts[i]->n;
        const int64_t lo = std::max(c0, start), hi = std::min(c1, end);
        if (lo < hi) parts[i]->columns(x, xb, a, y + start, ldy, m, lo - start, hi - start);
      }
      return;
    }
    if (kind == kF32Panels)
      f32_panels(x, m, k, weight.data_ptr<float>(), n, y, ldy, c0 / kPanel, (c1 + kPanel - 1) / kPanel);
    else if (kind == kBf16)
      bf16_columns(x, xb, reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()), y, ldy, m, k, c0, c1);
    else if (kind == kBf16Compact)
      compact_columns(xb, compact, y, ldy, m, c0, c1);
    else if (kind == kHalfPanels)
      half_panels(x, m, k, static_cast<const uint16_t*>(weight.data_ptr()), weight.scalar_type() == torch::kBFloat16,
                  n, y, ldy, c0 / kPanel, (c1 + kPanel - 1) / kPanel);
    else if (kind == kKQuant)
      kq_groups(a, weight.data_ptr<uint8_t>(), kq_type, y, ldy, m, k, n, c0 / kPanel, (c1 + kPanel - 1) / kPanel);
    else if (kind == kInt8)
      i8_groups(a, weight.data_ptr<uint8_t>(), scale.defined() ? scale.data_ptr<float>() : nullptr, y, ldy, m, k, n,
                c0 / kPanel, (c1 + kPanel - 1) / kPanel);
    else
      i4_groups(a, weight.data_ptr<uint8_t>(), y, ldy, m, k, n, c0 / kPanel, (c1 + kPanel - 1) / kPanel);
  }
};

std::shared_ptr<StackLinear> make_stack_linear(const std::string& kind, torch::Tensor weight,
                                          c10::optional<torch::Tensor> scale, c10::optional<torch::Tensor> bias,
                                          int64_t n) {
  auto out = std::make_shared<StackLinear>();
  TORCH_CHECK(weight.dim() == 2 || weight.dim() == 3 || kind == "bf16_vnni" || kind == "bf16_compact",
              "weight must be 2-D or 3-D (panels, INT8/INT4 blocks)");
  TORCH_CHECK(weight.is_contiguous(), "weight must be contiguous");
  out->weight = weight;
  out->n = n;
  if (kind == "f32") {  // panels of float32, or of bfloat16 / float16 weights widened as they are read
    const auto type = weight.scalar_type();
    TORCH_CHECK(weight.dim() == 3 && weight.size(2) == kPanel &&
                    (type == torch::kFloat32 || type == torch::kBFloat16 || type == torch::kHalf),
                "f32 weights must be float32, bfloat16 or float16 panels [N / 16, K, 16]");
    TORCH_CHECK(n > (weight.size(0) - 1) * kPanel && n <= weight.size(0) * kPanel, "n does not fit the panels");
    out->kind = type == torch::kFloat32 ? StackLinear::kF32Panels : StackLinear::kHalfPanels;
    out->k = weight.size(1);
  } else if (kind == "bf16") {
    TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16 && weight.size(0) == n,
                "bf16 weights must be bfloat16 [N, K]");
    out->kind = StackLinear::kBf16;
    out->k = weight.size(1);
  } else if (kind == "bf16_compact") {
    out->compact = compact_view(weight);
    TORCH_CHECK(out->compact.n == n, "a compact weight of ", out->compact.n, " rows for ", n, " outputs");
    out->kind = StackLinear::kBf16Compact;
    out->k = out->compact.k;
  } else if (kind == "bf16_vnni") {
    check_vnni(weight, n);
    out->kind = StackLinear::kBf16Vnni;
    out->k = weight.size(1) * 2;
  } else if (kind == "int8") {
    check_int8_blocks(weight, scale);
    check_groups_fit(weight, n);
    out->kind = StackLinear::kInt8;
    out->k = weight.size(1) * kBlock;
    if (scale) out->scale = *scale;
  } else if (kind == "int4") {
    check_int4_blocks(weight);
    check_groups_fit(weight, n);
    out->kind = StackLinear::kInt4;
    out->k = weight.size(1) * kBlock;
  } else if (kind == "q4_k" || kind == "q5_k" || kind == "q6_k") {
    out->kq_type = kind == "q4_k" ? 12 : kind == "q5_k" ? 13 : 14;
    check_kq_blocks(weight, out->kq_type);
    check_groups_fit(weight, n);
    out->kind = StackLinear::kKQuant;
    out->k = weight.size(1) * 256;
  } else {
    TORCH_CHECK(false, "unknown weight kind '", kind,
                "' (f32, bf16, bf16_vnni, bf16_compact, int8, int4, q4_k, q5_k or q6_k)");
  }
  TORCH_CHECK(!out->quantized() || out->k % kBlock == 0, "K must be a multiple of 32");
  if (bias) {
    TORCH_CHECK((bias->scalar_type() == torch::kFloat32 || bias->scalar_type() == torch::kBFloat16) &&
                    bias->is_contiguous() && bias->numel() == n,
                "bias must be contiguous float32 or bfloat16 [N]");
    out->bias = *bias;
  }
  return out;
}

// One projection from parts in different layouts, side by side in this order (each's columns a multiple of 16
// but the last's); the bias, if any, is the whole projection's. Parts stream: panels, INT8, INT4 or K-quants.
std::shared_ptr<StackLinear> make_fused_linear(std::vector<std::shared_ptr<StackLinear>> parts,
                                          c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(!parts.empty(), "a fused projection needs parts");
  auto out = std::make_shared<StackLinear>();
  out->kind = StackLinear::kF32Panels;  // (not read: the parts' kinds decide)
  out->k = parts.front()->k;
  for (const auto& part : parts) {
    TORCH_CHECK(part->parts.empty() && part->kind != StackLinear::kBf16 && part->kind != StackLinear::kBf16Vnni &&
                    part->kind != StackLinear::kBf16Compact &&
                    !part->bias.defined(),
                "a fused projection's parts must be unbiased panels, INT8, INT4 or K-quant weights");
    TORCH_CHECK(part->k == out->k, "a fused projection's parts must share their input size");
    TORCH_CHECK(out->n % kPanel == 0, "every part of a fused projection but the last must be whole groups of 16");
    out->starts.push_back(out->n);
    out->n += part->n;
  }
  out->parts = std::move(parts);
  if (bias) {
    TORCH_CHECK((bias->scalar_type() == torch::kFloat32 || bias->scalar_type() == torch::kBFloat16) &&
                    bias->is_contiguous() && bias->numel() == out->n,
                "bias must be contiguous float32 or bfloat16 [N]");
    out->bias = *bias;
  }
  return out;
}

struct StackLayer {
  std::shared_ptr<StackLinear> qkv, o, gate_up, down;
  torch::Tensor input_norm, post_norm;
  int64_t window;  // sliding window, 0 for none
  torch::Tensor q_norm, k_norm;  // [head_dim] RMSNorm weights applied to each q and k head before RoPE (Qwen3), or undefined
  // Gemma 2/3's sandwich: post_norm normalises the attention output (no residual add), pre_mlp_norm adds it to
  // the residual and normalises the MLP input, post_mlp_norm normalises the MLP output; undefined for Llama
  torch::Tensor pre_mlp_norm, post_mlp_norm;
  torch::Tensor cos, sin;  // this layer's own rotary tables (Gemma 3's local layers), or undefined: the step's
  bool gelu;               // GeGLU (Gemma) in place of SwiGLU
  LoRAWeights lora[4];     // the LoRA adapters of qkv, o, gate_up and down (lora/layers.py), or none
};

// [begin, end) of `units` for thread `tid` of `threads`, in near-equal runs.
inline std::pair<int64_t, int64_t> share(int64_t units, int tid, int threads) {
  return {units * tid / threads, units * (tid + 1) / threads};
}

// How a bfloat16 stack computes its bf16 projections. Plain weights: every one inside the stack's
// parallel region, by the streaming kernel (few rows) or the AVX512-BF16 GEMM, or each by oneDNN
// between the region's phases. Packed (VNNI) weights: inside the region, streamed (few rows) or by
// oneDNN's brgemm micro-kernel (AMX). ops/kernel_choice.py times them and picks per row count.
// INT8/INT4/K-quant weights stream (kStream) or, in a bfloat16 stack, are dequantized a block at a time for
// AMX tiles (kDequantAmx, quant_amx.cpp).
// kOrderedStream and kOrderedGemm read packed weights in the bf16 GEMM's order (--batch-invariant).
enum class Bf16Kernel { kStream, kGemm, kOneDnn, kVnniStream, kBrgemm, kDequantAmx, kOrderedStream, kOrderedGemm };

bool reads_packed(Bf16Kernel kernel) {
  return kernel == Bf16Kernel::kVnniStream || kernel == Bf16Kernel::kBrgemm || kernel == Bf16Kernel::kOrderedStream ||
         kernel == Bf16Kernel::kOrderedGemm;
}
bool uses_amx(Bf16Kernel kernel) { return kernel == Bf16Kernel::kBrgemm || kernel == Bf16Kernel::kDequantAmx; }

// The columns a thread's share of a projection is counted in: a block of 32 where the kernel works in
// AMX blocks, else a panel (or group) of 16.
int64_t share_unit(const StackLinear& w, Bf16Kernel kernel) {
  const bool blocks = w.kind == StackLinear::kBf16Vnni || (w.amx_readable() && kernel == Bf16Kernel::kDequantAmx);
  return blocks ? kVnniBlock : kPanel;
}

Bf16Kernel parse_bf16_kernel(const std::string& name) {
  if (name == "stream" || name == "compact_stream") return Bf16Kernel::kStream;  // (the weights' kind picks the
  if (name == "gemm" || name == "compact_gemm") {                                 // layout's kernel)
    TORCH_CHECK(bf16_gemm_compiled(), "the bfloat16 GEMM was not compiled (it needs AVX512-BF16)");
    return Bf16Kernel::kGemm;
  }
  if (name == "dequant_amx") {
    TORCH_CHECK(quant_amx_compiled(), "the AMX kernel for quantized weights is not available on this CPU or build");
    return Bf16Kernel::kDequantAmx;
  }
  if (name == "ordered_stream" || name == "ordered_gemm") {
    TORCH_CHECK(bf16_gemm_compiled(), "the ordered bfloat16 kernels need AVX512-BF16");
    return name == "ordered_gemm" ? Bf16Kernel::kOrderedGemm : Bf16Kernel::kOrderedStream;
  }
  if (name == "vnni_stream" || name == "brgemm") {
    TORCH_CHECK(vnni_compiled(), "the AMX kernels are not available on this CPU");
    return name == "brgemm" ? Bf16Kernel::kBrgemm : Bf16Kernel::kVnniStream;
  }
  TORCH_CHECK(name == "onednn", "unknown bfloat16 kernel '", name,
              "' (stream, gemm, onednn, vnni_stream, brgemm, ordered_stream, ordered_gemm or dequant_amx)");
  return Bf16Kernel::kOneDnn;
}

// One thread's view of a projection's input: its rows as float32 (converted from bfloat16 once a
// phase), for integer weights quantized, for the bf16 GEMM packed in pairs.
template <typename T>
struct ProjectionInput {
  std::vector<float> converted;
  QuantizedRows quantized;
  std::vector<uint32_t> pairs;
  const float* rows = nullptr;
  const uint16_t* bits = nullptr;  // the rows as they are, when they are bfloat16

  void prepare(const StackLinear& w, const T* x, int64_t m, Bf16Kernel kernel) {
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if ((kernel == Bf16Kernel::kGemm && (w.kind == StackLinear::kBf16 || w.kind == StackLinear::kBf16Compact)) ||
          (kernel == Bf16Kernel::kOrderedGemm && w.kind == StackLinear::kBf16Vnni))
        return pack_pairs(x, w.k, m, w.k, pairs);
      if (w.kind == StackLinear::kBf16Vnni || (w.amx_readable() && kernel == Bf16Kernel::kDequantAmx)) {
        // the packed kernels and the dequantizing one read the rows as they are
        bits = reinterpret_cast<const uint16_t*>(x);
        return;
      }
    }
    if constexpr (std::is_same_v<T, float>) {
      rows = x;
      if (w.quantized()) quantize_rows(rows, m, w.k, quantized);
    } else {
      bits = reinterpret_cast<const uint16_t*>(x);
      if (w.quantized()) quantize_rows(bits, m, w.k, quantized);  // from the bits: no float copy
      if (!w.reads_floats()) return;
      converted.resize(m * w.k);
      for (int64_t i = 0; i < m * w.k; ++i) converted[i] = static_cast<float>(x[i]);
      rows = converted.data();
    }
  }
};

class DecodeStack {
 public:
  // `scale`: the attention softmax scale (head_dim ** -0.5, or Gemma's query_pre_attn_scalar ** -0.5);
  // `softcap` > 0: the attention scores capped, softcap * tanh(s / softcap) (Gemma 2)
  DecodeStack(int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
              torch::Tensor final_norm, double scale, double softcap)
      : hidden_(hidden), heads_(num_heads), kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps),
        scale_(scale), softcap_(softcap), dtype_(final_norm.scalar_type()), final_norm_(final_norm) {
    TORCH_CHECK(num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads");
    TORCH_CHECK(dtype_ == torch::kFloat32 || dtype_ == torch::kBFloat16, "the stack runs float32 or bfloat16");
    check_norm(final_norm);
  }

  void add_layer(std::shared_ptr<StackLinear> qkv, std::shared_ptr<StackLinear> o,
                 std::shared_ptr<StackLinear> gate_up, std::shared_ptr<StackLinear> down, torch::Tensor input_norm,
                 torch::Tensor post_norm, int64_t window, c10::optional<torch::Tensor> q_norm,
                 c10::optional<torch::Tensor> k_norm, c10::optional<torch::Tensor> pre_mlp_norm,
                 c10::optional<torch::Tensor> post_mlp_norm, c10::optional<torch::Tensor> cos,
                 c10::optional<torch::Tensor> sin, const std::string& activation) {
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q and k norms come together");
    TORCH_CHECK(pre_mlp_norm.has_value() == post_mlp_norm.has_value(), "the MLP's two norms come together");
    TORCH_CHECK(cos.has_value() == sin.has_value(), "a layer's cos and sin tables come together");
    TORCH_CHECK(activation == "silu" || activation == "gelu_tanh", "unknown MLP activation '", activation,
                "' (silu or gelu_tanh)");
    for (const auto* t : {&cos, &sin})
      TORCH_CHECK(!t->has_value() || ((*t)->scalar_type() == dtype_ && (*t)->is_contiguous() && (*t)->dim() == 2 &&
                                      (*t)->size(1) == head_dim_),
                  "a layer's cos and sin must be contiguous [max_positions, D] of the stack's dtype");
    if (pre_mlp_norm.has_value()) {
      check_norm(*pre_mlp_norm);
      check_norm(*post_mlp_norm);
    }
    for (const auto* w : {&q_norm, &k_norm}) {
      TORCH_CHECK(!w->has_value() || ((*w)->scalar_type() == dtype_ && (*w)->is_contiguous() &&
                                      (*w)->numel() == head_dim_),
                  "q/k norm weights must be contiguous [head_dim] of the stack's dtype");
    }
    const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    TORCH_CHECK(qkv->k == hidden_ && qkv->n == q_size + 2 * kv_size, "qkv must map hidden to q, k, v");
    TORCH_CHECK(o->k == q_size && o->n == hidden_, "o must map the heads to hidden");
    TORCH_CHECK(gate_up->k == hidden_ && gate_up->n % (2 * kPanel) == 0, "gate_up must map hidden to 2 x I, I % 16 == 0");
    TORCH_CHECK(down->k == gate_up->n / 2 && down->n == hidden_, "down must map I to hidden");
    TORCH_CHECK(layers_.empty() || gate_up->n == layers_.front().gate_up->n, "every layer must have one width");
    const int64_t unit = gate_up->kind == StackLinear::kBf16Vnni ? kVnniBlock : kPanel;
    TORCH_CHECK(gate_up->n % (2 * unit) == 0, "gate_up's halves must be whole blocks of ", unit);
    for (const auto* w : {&qkv, &o, &gate_up, &down}) {
      TORCH_CHECK(!(*w)->bias.defined() || (*w)->bias.scalar_type() == dtype_, "biases must have the stack's dtype");
      TORCH_CHECK(((*w)->kind != StackLinear::kBf16Vnni && (*w)->kind != StackLinear::kBf16Compact) ||
                      dtype_ == torch::kBFloat16,
                  "packed and compact bfloat16 weights need a bfloat16 stack");
    }
    check_norm(input_norm);
    for (const auto* w : {&qkv, &o, &gate_up, &down}) {  // what forward checks each step's kernel against
      has_plain_bf16_ |= (*w)->kind == StackLinear::kBf16;
      has_packed_ |= (*w)->kind == StackLinear::kBf16Vnni;
      has_compact_ |= (*w)->kind == StackLinear::kBf16Compact;
      all_quantized_ &= (*w)->amx_readable();
    }
    check_norm(post_norm);
    layers_.push_back({qkv, o, gate_up, down, input_norm, post_norm, window, q_norm.value_or(torch::Tensor()),
                       k_norm.value_or(torch::Tensor()), pre_mlp_norm.value_or(torch::Tensor()),
                       post_mlp_norm.value_or(torch::Tensor()), cos.value_or(torch::Tensor()),
                       sin.value_or(torch::Tensor()), activation == "gelu_tanh"});
  }

  // Layer `layer`'s projection `index` (0 qkv, 1 o, 2 gate_up, 3 down) gets LoRA adapters (lora.h): a forward
  // with lora_slots adds each row's adapter delta to that projection's output. The tensors are held, not
  // copied: adapters loaded into them later are read as they are.
  void set_lora(int64_t layer, int64_t index, torch::Tensor a, torch::Tensor b_t, int64_t share,
                torch::Tensor part_columns) {
    TORCH_CHECK(layer >= 0 && layer < num_layers() && index >= 0 && index < 4, "no projection ", index,
                " of layer ", layer);
    StackLayer& target = layers_[layer];
    const StackLinear& w = *(index == 0 ? target.qkv : index == 1 ? target.o : index == 2 ? target.gate_up : target.down);
    check_lora_weights(a, b_t, share, part_columns, dtype_, w.k, w.n);
    TORCH_CHECK(lora_slots_ == 0 || a.size(0) / share == lora_slots_, "every projection's LoRA must hold one number of slots");
    target.lora[index] = {a, b_t, part_columns, share};
    lora_slots_ = a.size(0) / share;
    max_lora_share_ = std::max(max_lora_share_, share);
  }

  // hidden [S, H]: the embedding rows of S decoding sequences, one token each; the rest as for
  // fused_decode_attention, with one K and one V pool per layer. `bf16_kernel`: stream, gemm or
  // onednn (see Bf16Kernel; float32 and integer weights ignore it). `kv_first`: every row's K/V is written
  // before any row attends, so rows of one sequence at successive positions (speculative decoding's
  // verification) see each other. `lora_slots` (int64 [S], -1 for none): each row's LoRA adapter slot (set_lora).
  // `stop` (int32 [1]): another thread sets it non-zero to end the step after the layer in flight (a request
  // that must not wait for this step: model/step_interrupt.py); the step then returns [0, H].
  // Returns the final norm's output [S, H].
  torch::Tensor forward(torch::Tensor hidden, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                        std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches, torch::Tensor slots,
                        torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size,
                        const std::string& bf16_kernel, bool kv_first,
                        const c10::optional<torch::Tensor>& lora_slots,
                        const c10::optional<torch::Tensor>& stop) const {
    check_step(hidden, positions, cos, sin, k_caches, v_caches, slots, block_tables, context_lens, block_size);
    const int32_t* stop_flag = nullptr;
    if (stop.has_value()) {
      TORCH_CHECK(stop->scalar_type() == torch::kInt32 && stop->numel() == 1 && stop->device().is_cpu(),
                  "stop must be one int32 on the CPU");
      stop_flag = stop->data_ptr<int32_t>();
    }
    std::vector<int64_t> adapter_rows;  // the rows with an adapter (lora.h)
    const int64_t* row_slots = nullptr;
    if (lora_slots.has_value()) {
      TORCH_CHECK(lora_slots_ > 0, "lora_slots given, but the stack holds no LoRA adapters");
      TORCH_CHECK(lora_slots->scalar_type() == torch::kInt64 && lora_slots->is_contiguous() &&
                      lora_slots->numel() == hidden.size(0),
                  "lora_slots must be contiguous int64 [S]");
      row_slots = lora_slots->data_ptr<int64_t>();
      adapter_rows = lora_rows(row_slots, hidden.size(0), lora_slots_);
    }
    const StepLoRA lora{adapter_rows, row_slots};
    const Bf16Kernel kernel = parse_bf16_kernel(bf16_kernel);
    TORCH_CHECK(!(has_packed_ && !reads_packed(kernel)) && !(has_plain_bf16_ && reads_packed(kernel)),
                "bfloat16 kernel '", bf16_kernel, "' does not read this stack's ",
                reads_packed(kernel) ? "plain" : "packed", " weights");
    TORCH_CHECK(!has_compact_ || kernel == Bf16Kernel::kStream || kernel == Bf16Kernel::kGemm,
                "bfloat16 kernel '", bf16_kernel, "' does not read this stack's compact weights");
    if (kernel == Bf16Kernel::kDequantAmx) {
      TORCH_CHECK(dtype_ == torch::kBFloat16, "kernel 'dequant_amx' runs bfloat16 stacks only");
      TORCH_CHECK(all_quantized_, "kernel 'dequant_amx' reads INT8, INT4 and K-quant weights only");
      TORCH_CHECK(layers_.front().gate_up->n % (2 * kVnniBlock) == 0,  // (every layer has one width)
                  "kernel 'dequant_amx' needs gate_up halves of whole blocks of 32");
    }
    if (dtype_ == torch::kFloat32)
      return run<float>(hidden, positions, cos, sin, k_caches, v_caches, slots, block_tables, context_lens, block_size,
                        Bf16Kernel::kStream, kv_first, lora, stop_flag);
    return run<at::BFloat16>(hidden, positions, cos, sin, k_caches, v_caches, slots, block_tables, context_lens,
                             block_size, kernel, kv_first, lora, stop_flag);
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  struct StepLoRA {  // a step's rows with a LoRA adapter, and every row's slot
    const std::vector<int64_t>& rows;
    const int64_t* slots;
    bool on(const LoRAWeights& w) const { return !rows.empty() && w.defined(); }
  };

  // Every phase in one parallel region, the projections by llmaccel's kernels; with kOneDnn each
  // bfloat16 projection is one oneDNN GEMM (at::linear, as the layer-by-layer path calls it) between
  // the parallel phases instead.
  template <typename T>
  torch::Tensor run(const torch::Tensor& hidden, const torch::Tensor& positions, const torch::Tensor& cos,
                    const torch::Tensor& sin, const std::vector<torch::Tensor>& k_caches,
                    const std::vector<torch::Tensor>& v_caches, const torch::Tensor& slots,
                    const torch::Tensor& block_tables, const torch::Tensor& context_lens, int64_t block_size,
                    Bf16Kernel kernel, bool kv_first, const StepLoRA& lora, const int32_t* stop_flag) const {
    const int64_t seqs = hidden.size(0);
    // read by one thread at the end of each layer; every thread then leaves at the same layer boundary
    auto stop_asked = [stop_flag] {
      return stop_flag != nullptr && __atomic_load_n(stop_flag, __ATOMIC_RELAXED) != 0;
    };
    bool stopped = false;
    const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_, group = heads_ / kv_heads_;
    const bool int8_kv = k_caches.front().scalar_type() == torch::kInt8;
    const int64_t qkv_n = q_size + 2 * kv_size, inter = layers_.front().gate_up->n / 2;
    auto opts = hidden.options();
    auto residual = hidden.contiguous().clone(), normed = torch::empty({seqs, hidden_}, opts);
    auto pending = torch::empty({seqs, hidden_}, opts);  // what the next norm adds to the residual stream first
    auto qkv = torch::empty({seqs, qkv_n}, opts), attn = torch::empty({seqs, q_size}, opts);
    auto gate_up = torch::empty({seqs, 2 * inter}, opts), act = torch::empty({seqs, inter}, opts);
    // bfloat16 steps: the projections' float32 sums, rounded into the activations column by column
    torch::Tensor sums = torch::empty({std::is_same_v<T, float> ? 0 : seqs * std::max(qkv_n, 2 * inter)},
                                      opts.dtype(torch::kFloat32));
    T *res = residual.data_ptr<T>(), *xn = normed.data_ptr<T>(), *add = pending.data_ptr<T>();
    T *qkv_p = qkv.data_ptr<T>(), *attn_p = attn.data_ptr<T>(), *gu = gate_up.data_ptr<T>(), *act_p = act.data_ptr<T>();
    float* sums_p = sums.data_ptr<float>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    const int32_t* tables = block_tables.data_ptr<int32_t>();
    const int32_t* lens = context_lens.data_ptr<int32_t>();
    const T *cos_p = cos.data_ptr<T>(), *sin_p = sin.data_ptr<T>();
    const int64_t max_blocks = block_tables.size(1);
    const float scale = static_cast<float>(scale_), softcap = static_cast<float>(softcap_);
    const float eps = static_cast<float>(eps_);

    // The phases; each takes this thread's number and the team's size.
    // The first norm has nothing to add (a norm with a zero residual sums in another order: the
    // compiler vectorises the two cases differently).
    auto norm_rows = [&](int tid, int threads, const torch::Tensor& weight, bool first) {
      const auto rows = share(seqs, tid, threads);
      for (int64_t r = rows.first; r < rows.second; ++r)
        rms_norm_row(first ? res + r * hidden_ : add + r * hidden_, first ? nullptr : res + r * hidden_,
                     weight.data_ptr<T>(), xn + r * hidden_, hidden_, eps);
    };
    // a sandwich norm: the rows of `add` normalised in place, nothing added
    auto norm_in_place = [&](int tid, int threads, const torch::Tensor& weight) {
      const auto rows = share(seqs, tid, threads);
      for (int64_t r = rows.first; r < rows.second; ++r)
        rms_norm_row(add + r * hidden_, nullptr, weight.data_ptr<T>(), add + r * hidden_, hidden_, eps);
    };
    auto activate = [](const StackLayer& layer, const T* g, const T* u, T* out, int64_t count) {
      if (layer.gelu)
        gelu_mul_row(g, u, out, count);
      else
        silu_mul_row(g, u, out, count);
    };
    // columns [c0, c1) of y = x W^T + b, rounded to T as the layer-by-layer path rounds them (the
    // bias added after the product's rounding, as torch adds it)
    auto columns = [&](ProjectionInput<T>& input, const StackLinear& w, T* y, int64_t ldy, int64_t c0, int64_t c1) {
      if (!input.pairs.empty() && w.kind == StackLinear::kBf16) {
        if constexpr (std::is_same_v<T, at::BFloat16>)
          bf16_gemm_columns(input.pairs.data(), seqs, reinterpret_cast<const uint16_t*>(w.weight.data_ptr<T>()), w.k,
                            y, ldy, c0, c1);
      } else if (!input.pairs.empty() && w.kind == StackLinear::kBf16Compact) {
        if constexpr (std::is_same_v<T, at::BFloat16>) compact_gemm_columns(input.pairs.data(), seqs, w.compact, y, ldy, c0, c1);
      } else if (w.amx_readable() && kernel == Bf16Kernel::kDequantAmx) {
        if constexpr (std::is_same_v<T, at::BFloat16>)  // (checked: a bfloat16 stack)
          w.amx_columns(input.bits, seqs, y, ldy, c0, c1);
      } else if (w.kind == StackLinear::kBf16Vnni) {
        if constexpr (std::is_same_v<T, at::BFloat16>) {  // (a float32 stack takes no packed weights)
          const auto* packed = reinterpret_cast<const uint16_t*>(w.weight.data_ptr<at::BFloat16>());
          if (kernel == Bf16Kernel::kBrgemm)
            vnni_brgemm_columns(input.bits, w.k, seqs, w.k, packed, y, ldy, c0, c1);
          else if (kernel == Bf16Kernel::kOrderedGemm)
            bf16_gemm_vnni_columns(input.pairs.data(), seqs, packed, w.k, y, ldy, c0, c1);
          else if (kernel == Bf16Kernel::kOrderedStream)
            vnni_ordered_columns(input.bits, w.k, seqs, w.k, packed, y, ldy, c0, c1);
          else
            vnni_stream_columns(input.bits, w.k, seqs, w.k, packed, y, ldy, c0, c1);
        }
      } else if constexpr (std::is_same_v<T, float>) {
        w.columns(input.rows, input.bits, input.quantized, y, ldy, seqs, c0, c1);
      } else {
        w.columns(input.rows, input.bits, input.quantized, sums_p, ldy, seqs, c0, c1);
        for (int64_t i = 0; i < seqs; ++i)
          for (int64_t c = c0; c < c1; ++c) y[i * ldy + c] = static_cast<T>(sums_p[i * ldy + c]);
      }
      if (w.bias.defined()) {
        const T* b = w.bias.data_ptr<T>();
        for (int64_t i = 0; i < seqs; ++i)
          for (int64_t c = c0; c < c1; ++c) y[i * ldy + c] = static_cast<T>(to_float(y[i * ldy + c]) + to_float(b[c]));
      }
    };
    // LoRA: the rows' shrinks split between the threads (then a barrier: every thread expands into its columns
    // from all of them), and the expansion of columns [c0, c1) once they hold the projection's output
    const int64_t lora_count = static_cast<int64_t>(lora.rows.size());
    std::vector<float> shrink(lora_count * max_lora_share_);
    auto lora_shrink_rows = [&](int tid, int threads, const LoRAWeights& l, const T* x, int64_t k) {
      const auto part = share(lora_count, tid, threads);
      lora_shrink(x, k, k, l.a.data_ptr<T>(), l.share, lora.rows.data(), lora.slots, part.first, part.second,
                  shrink.data());
    };
    auto lora_expand_columns = [&](const LoRAWeights& l, T* y, int64_t ldy, int64_t c0, int64_t c1) {
      lora_expand(shrink.data(), lora_count, l.b_t.data_ptr<T>(), l.b_t.size(1), l.share,
                  l.part_columns.data_ptr<int64_t>(), l.part_columns.size(0), lora.rows.data(), lora.slots, y, ldy,
                  c0, c1);
    };
    auto project = [&](int tid, int threads, ProjectionInput<T>& input, const StackLinear& w, const T* x, T* y,
                       const LoRAWeights& l) {
      input.prepare(w, x, seqs, kernel);
      if (lora.on(l)) {
        lora_shrink_rows(tid, threads, l, x, w.k);
#pragma omp barrier
      }
      const int64_t unit = share_unit(w, kernel);
      const auto range = share((w.n + unit - 1) / unit, tid, threads);
      const int64_t c0 = range.first * unit, c1 = std::min(w.n, range.second * unit);
      columns(input, w, y, w.n, c0, c1);
      if (lora.on(l)) lora_expand_columns(l, y, w.n, c0, c1);
    };
    // RoPE on an item's query and key heads (each normalised first where the layer has q/k norms, as the
    // layer path's RMSNorm over [tokens * heads, head_dim] does), and its key and value into the pool
    auto rotate_and_write = [&](int64_t item, size_t l) {
      const int64_t s = item / kv_heads_, kvh = item % kv_heads_;
      T* row = qkv_p + s * qkv_n;
      T *q = row + kvh * group * head_dim_, *k = row + q_size + kvh * head_dim_;
      const StackLayer& layer = layers_[l];
      const T* layer_cos = layer.cos.defined() ? layer.cos.data_ptr<T>() : cos_p;
      const T* layer_sin = layer.sin.defined() ? layer.sin.data_ptr<T>() : sin_p;
      const T *c = layer_cos + pos[s] * head_dim_, *sn = layer_sin + pos[s] * head_dim_;
      if (layer.q_norm.defined()) {
        for (int64_t h = 0; h < group; ++h)
          rms_norm_row(q + h * head_dim_, nullptr, layer.q_norm.data_ptr<T>(), q + h * head_dim_, head_dim_, eps);
        rms_norm_row(k, nullptr, layer.k_norm.data_ptr<T>(), k, head_dim_, eps);
      }
      rope_heads(q, group, head_dim_, c, sn);
      rope_heads(k, 1, head_dim_, c, sn);
      if (int8_kv) {  // each row quantized as it is written (kv_int8.cpp)
        const int64_t offset = (slot[s] * kv_heads_ + kvh) * (head_dim_ + 2);
        quantize_kv_row(k, head_dim_, k_caches[l].data_ptr<int8_t>() + offset);
        quantize_kv_row(k + kv_size, head_dim_, v_caches[l].data_ptr<int8_t>() + offset);
        return;
      }
      std::memcpy(k_caches[l].data_ptr<T>() + slot[s] * kv_size + kvh * head_dim_, k, head_dim_ * sizeof(T));
      std::memcpy(v_caches[l].data_ptr<T>() + slot[s] * kv_size + kvh * head_dim_, k + kv_size, head_dim_ * sizeof(T));
    };
    // A thread's items on pools of T, or of int8 rows (kv_int8.cpp)
    auto attend_items = [&](std::pair<int64_t, int64_t> items, size_t l, AttentionScratch& scratch, bool written,
                            const auto* k_pool, const auto* v_pool) {
      for (int64_t item = items.first; item < items.second; ++item) {
        const int64_t s = item / kv_heads_, kvh = item % kv_heads_;
        if (!written) rotate_and_write(item, l);
        if (item + 1 < items.second) {
          const int64_t next = (item + 1) / kv_heads_;
          prefetch_item(k_pool, v_pool, tables + next * max_blocks, lens[next], layers_[l].window,
                        (item + 1) % kv_heads_, kv_heads_, head_dim_, block_size);
        }
        attend_item(qkv_p + s * qkv_n + kvh * group * head_dim_, k_pool, v_pool, tables + s * max_blocks, lens[s],
                    layers_[l].window, kvh, group, kv_heads_, head_dim_, block_size, scale, softcap,
                    attn_p + s * q_size + kvh * group * head_dim_, scratch);
      }
    };
    // `written`: every item's K/V is already in the pool (kv_first: rows of one sequence read each other's)
    auto attention = [&](int tid, int threads, size_t l, AttentionScratch& scratch, bool written) {
      const auto items = share(seqs * kv_heads_, tid, threads);
      if (int8_kv)
        attend_items(items, l, scratch, written, k_caches[l].data_ptr<int8_t>(), v_caches[l].data_ptr<int8_t>());
      else
        attend_items(items, l, scratch, written, k_caches[l].data_ptr<T>(), v_caches[l].data_ptr<T>());
    };
    auto write_all = [&](int tid, int threads, size_t l) {
      const auto items = share(seqs * kv_heads_, tid, threads);
      for (int64_t item = items.first; item < items.second; ++item) rotate_and_write(item, l);
    };

    if (kernel != Bf16Kernel::kOneDnn) {
#pragma omp parallel num_threads(at::get_num_threads())
      {
        const int tid = omp_get_thread_num(), threads = omp_get_num_threads();
        ProjectionInput<T> input;
        AttentionScratch scratch;
        for (size_t l = 0; l < layers_.size(); ++l) {
          const StackLayer& layer = layers_[l];
          norm_rows(tid, threads, layer.input_norm, l == 0);
#pragma omp barrier
          project(tid, threads, input, *layer.qkv, xn, qkv_p, layer.lora[0]);
#pragma omp barrier
          if (kv_first) {
            write_all(tid, threads, l);
#pragma omp barrier
          }
          attention(tid, threads, l, scratch, kv_first);
#pragma omp barrier
          project(tid, threads, input, *layer.o, attn_p, add, layer.lora[1]);
#pragma omp barrier
          if (layer.pre_mlp_norm.defined()) {  // sandwich: the attention output normalised, then added
            norm_in_place(tid, threads, layer.post_norm);
            norm_rows(tid, threads, layer.pre_mlp_norm, false);  // (the same rows: no barrier between)
          } else {
            norm_rows(tid, threads, layer.post_norm, false);
          }
#pragma omp barrier
          // gate and up columns of the same range go together, so SiLU-and-mul needs no pass of its own
          input.prepare(*layer.gate_up, xn, seqs, kernel);
          if (lora.on(layer.lora[2])) {
            lora_shrink_rows(tid, threads, layer.lora[2], xn, hidden_);
#pragma omp barrier
          }
          const int64_t unit = share_unit(*layer.gate_up, kernel);
          const auto range = share(inter / unit, tid, threads);
          const int64_t c0 = range.first * unit, c1 = range.second * unit;
          columns(input, *layer.gate_up, gu, 2 * inter, c0, c1);
          columns(input, *layer.gate_up, gu, 2 * inter, inter + c0, inter + c1);
          if (lora.on(layer.lora[2])) {
            lora_expand_columns(layer.lora[2], gu, 2 * inter, c0, c1);
            lora_expand_columns(layer.lora[2], gu, 2 * inter, inter + c0, inter + c1);
          }
          for (int64_t r = 0; r < seqs; ++r)
            activate(layer, gu + r * 2 * inter + c0, gu + r * 2 * inter + inter + c0, act_p + r * inter + c0, c1 - c0);
#pragma omp barrier
          project(tid, threads, input, *layer.down, act_p, add, layer.lora[3]);
          if (tid == 0) stopped = stop_asked();  // seen by all after the barrier
#pragma omp barrier
          if (layer.post_mlp_norm.defined()) {
            norm_in_place(tid, threads, layer.post_mlp_norm);
#pragma omp barrier
          }
          if (stopped) break;
        }
        if (!stopped) norm_rows(tid, threads, final_norm_, false);
        if (uses_amx(kernel)) vnni_release();
      }
      return stopped ? normed.narrow(0, 0, 0) : normed;
    }

    auto in_parallel = [&](auto phase) {
#pragma omp parallel num_threads(at::get_num_threads())
      phase(omp_get_thread_num(), omp_get_num_threads());
    };
    // a projection oneDNN computed gets its LoRA deltas in two phases of their own
    auto linear = [&](const StackLinear& w, const LoRAWeights& l, const torch::Tensor& x, const torch::Tensor& out) {
      torch::Tensor y = serial_linear<T>(w, l, x, out, project, in_parallel);
      if (w.kind == StackLinear::kBf16 && lora.on(l)) {
        const T* xp = x.data_ptr<T>();
        in_parallel([&](int tid, int threads) { lora_shrink_rows(tid, threads, l, xp, w.k); });
        in_parallel([&](int tid, int threads) {
          const auto range = share(w.n, tid, threads);
          lora_expand_columns(l, y.data_ptr<T>(), w.n, range.first, range.second);
        });
      }
      return y;
    };
    torch::Tensor qkv_out, o_out, gu_out, down_out;  // alive until the phase after the next reads them
    for (size_t l = 0; l < layers_.size(); ++l) {
      const StackLayer& layer = layers_[l];
      in_parallel([&](int tid, int threads) { norm_rows(tid, threads, layer.input_norm, l == 0); });
      qkv_out = linear(*layer.qkv, layer.lora[0], normed, qkv);
      qkv_p = qkv_out.data_ptr<T>();
      if (kv_first) in_parallel([&](int tid, int threads) { write_all(tid, threads, l); });
      in_parallel([&](int tid, int threads) {
        AttentionScratch scratch;
        attention(tid, threads, l, scratch, kv_first);
      });
      o_out = linear(*layer.o, layer.lora[1], attn, pending);
      add = o_out.data_ptr<T>();
      in_parallel([&](int tid, int threads) {
        if (layer.pre_mlp_norm.defined()) {
          norm_in_place(tid, threads, layer.post_norm);
          norm_rows(tid, threads, layer.pre_mlp_norm, false);
        } else {
          norm_rows(tid, threads, layer.post_norm, false);
        }
      });
      gu_out = linear(*layer.gate_up, layer.lora[2], normed, gate_up);
      const T* gu_p = gu_out.data_ptr<T>();
      in_parallel([&](int tid, int threads) {
        const auto rows = share(seqs, tid, threads);
        for (int64_t r = rows.first; r < rows.second; ++r)
          activate(layer, gu_p + r * 2 * inter, gu_p + r * 2 * inter + inter, act_p + r * inter, inter);
      });
      down_out = linear(*layer.down, layer.lora[3], act, pending);
      add = down_out.data_ptr<T>();
      if (layer.post_mlp_norm.defined())
        in_parallel([&](int tid, int threads) { norm_in_place(tid, threads, layer.post_mlp_norm); });
      if (stop_asked()) return normed.narrow(0, 0, 0);
    }
    in_parallel([&](int tid, int threads) { norm_rows(tid, threads, final_norm_, false); });
    return normed;
  }

  // y = x W^T (+ b) outside a parallel region: oneDNN's GEMM for bfloat16 weights (the layer path's
  // F.linear), llmaccel's kernel in a parallel phase otherwise (into `out`).
  template <typename T, typename Project, typename InParallel>
  static torch::Tensor serial_linear(const StackLinear& w, const LoRAWeights& l, const torch::Tensor& x,
                                     const torch::Tensor& out, Project& project, InParallel& in_parallel) {
    if (w.kind == StackLinear::kBf16) return at::linear(x, w.weight, w.bias.defined() ? w.bias : torch::Tensor());
    in_parallel([&](int tid, int threads) {
      ProjectionInput<T> input;
      project(tid, threads, input, w, x.data_ptr<T>(), out.data_ptr<T>(), l);
    });
    return out;
  }

  void check_norm(const torch::Tensor& w) const {
    TORCH_CHECK(w.scalar_type() == dtype_ && w.is_contiguous() && w.numel() == hidden_,
                "norm weights must be contiguous [hidden], all of one dtype");
  }

  // Everything the parallel region reads is checked here: nothing in it may throw.
  void check_step(const torch::Tensor& hidden, const torch::Tensor& positions, const torch::Tensor& cos,
                  const torch::Tensor& sin, const std::vector<torch::Tensor>& k_caches,
                  const std::vector<torch::Tensor>& v_caches, const torch::Tensor& slots,
                  const torch::Tensor& block_tables, const torch::Tensor& context_lens, int64_t block_size) const {
    TORCH_CHECK(!layers_.empty(), "the stack has no layers");
    TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == hidden_ && hidden.scalar_type() == dtype_,
                "hidden must be [S, ", hidden_, "] of the stack's dtype");
    const int64_t seqs = hidden.size(0);
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == num_layers() &&
                    static_cast<int64_t>(v_caches.size()) == num_layers(),
                "one K and one V pool a layer");
    const int64_t num_slots = k_caches.front().size(0);
    for (const auto* pools : {&k_caches, &v_caches})
      for (const auto& pool : *pools)
        TORCH_CHECK(pool.scalar_type() == k_caches.front().scalar_type() && pool.is_contiguous() && pool.dim() == 3 &&
                        pool.size(0) == num_slots && pool.size(1) == kv_heads_ &&
                        (pool.scalar_type() == dtype_ ? pool.size(2) == head_dim_
                                                      : pool.scalar_type() == torch::kInt8 && pool.size(2) == head_dim_ + 2),
                    "KV pools must be contiguous [slots, KVH, D] of the stack's dtype (int8: [slots, KVH, D + 2]), "
                    "all alike");
    for (const auto* t : {&cos, &sin})
      TORCH_CHECK(t->scalar_type() == dtype_ && t->is_contiguous() && t->dim() == 2 && t->size(1) == head_dim_,
                  "cos and sin must be contiguous [max_positions, D] of the stack's dtype");
    TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous() && positions.numel() == seqs,
                "positions must be contiguous int64 [S]");
    TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous() && slots.numel() == seqs,
                "slots must be contiguous int64 [S]");
    TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.is_contiguous() &&
                    block_tables.dim() == 2 && block_tables.size(0) == seqs,
                "block_tables must be contiguous int32 [S, max_blocks]");
    TORCH_CHECK(context_lens.scalar_type() == torch::kInt32 && context_lens.is_contiguous() &&
                    context_lens.numel() == seqs,
                "context_lens must be contiguous int32 [S]");
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    const int32_t* lens = context_lens.data_ptr<int32_t>();
    const int32_t* tables = block_tables.data_ptr<int32_t>();
    const int64_t num_blocks = num_slots / block_size;
    for (int64_t s = 0; s < seqs; ++s) {
      TORCH_CHECK(pos[s] >= 0 && pos[s] < cos.size(0), "position ", pos[s], " is outside the rotary table");
      for (const auto& layer : layers_)
        TORCH_CHECK(!layer.cos.defined() || pos[s] < layer.cos.size(0), "position ", pos[s],
                    " is outside a layer's rotary table");
      TORCH_CHECK(slot[s] >= 0 && slot[s] < num_slots, "slot ", slot[s], " is outside the KV pool of ", num_slots);
      TORCH_CHECK(lens[s] >= 1 && lens[s] <= block_tables.size(1) * block_size, "context length ", lens[s],
                  " does not fit the block table");
      for (int64_t b = 0; b < (lens[s] + block_size - 1) / block_size; ++b) {
        const int32_t block = tables[s * block_tables.size(1) + b];
        TORCH_CHECK(block >= 0 && block < num_blocks, "block ", block, " is outside the KV pool");
      }
    }
  }

  int64_t hidden_, heads_, kv_heads_, head_dim_;
  double eps_, scale_, softcap_;
  torch::ScalarType dtype_;
  torch::Tensor final_norm_;
  std::vector<StackLayer> layers_;
  bool has_plain_bf16_ = false, has_packed_ = false, has_compact_ = false, all_quantized_ = true;  // over every layer's projections
  int64_t lora_slots_ = 0;  // adapter slots every projection's LoRA holds (set_lora), 0 for none
  int64_t max_lora_share_ = 0;  // the largest LoRA share of any projection: a step's shrinks hold a row's for each
};

// The handles bindings.cpp exposes (decode_stack.h): each forwards to the class above.
LinearHandle stack_linear(const std::string& kind, torch::Tensor weight, c10::optional<torch::Tensor> scale,
                          c10::optional<torch::Tensor> bias, int64_t n) {
  return {make_stack_linear(kind, weight, scale, bias, n)};
}

LinearHandle fused_linear(std::vector<LinearHandle> parts, c10::optional<torch::Tensor> bias) {
  std::vector<std::shared_ptr<StackLinear>> linears;
  for (auto& part : parts) linears.push_back(part.linear);
  return {make_fused_linear(std::move(linears), bias)};
}

DecodeStackHandle::DecodeStackHandle(int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                     double eps, torch::Tensor final_norm, double scale, double softcap)
    : stack_(std::make_shared<DecodeStack>(hidden, num_heads, num_kv_heads, head_dim, eps, final_norm, scale,
                                           softcap)) {}

void DecodeStackHandle::add_layer(LinearHandle qkv, LinearHandle o, LinearHandle gate_up, LinearHandle down,
                                  torch::Tensor input_norm, torch::Tensor post_norm, int64_t window,
                                  c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm,
                                  c10::optional<torch::Tensor> pre_mlp_norm, c10::optional<torch::Tensor> post_mlp_norm,
                                  c10::optional<torch::Tensor> cos, c10::optional<torch::Tensor> sin,
                                  const std::string& activation) {
  stack_->add_layer(qkv.linear, o.linear, gate_up.linear, down.linear, input_norm, post_norm, window, q_norm, k_norm,
                    pre_mlp_norm, post_mlp_norm, cos, sin, activation);
}

torch::Tensor DecodeStackHandle::forward(torch::Tensor hidden, torch::Tensor positions, torch::Tensor cos,
                                         torch::Tensor sin, std::vector<torch::Tensor> k_caches,
                                         std::vector<torch::Tensor> v_caches, torch::Tensor slots,
                                         torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size,
                                         const std::string& bf16_kernel, bool kv_first,
                                         c10::optional<torch::Tensor> lora_slots,
                                         c10::optional<torch::Tensor> stop) const {
  return stack_->forward(hidden, positions, cos, sin, std::move(k_caches), std::move(v_caches), slots, block_tables,
                         context_lens, block_size, bf16_kernel, kv_first, lora_slots, stop);
}

void DecodeStackHandle::set_lora(int64_t layer, int64_t index, torch::Tensor a, torch::Tensor b_t, int64_t share,
                                 torch::Tensor part_columns) {
  stack_->set_lora(layer, index, a, b_t, share, part_columns);
}

int64_t DecodeStackHandle::num_layers() const { return stack_->num_layers(); }

}  // namespace llmaccel
