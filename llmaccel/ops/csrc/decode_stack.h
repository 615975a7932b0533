// The decode stack (decode_stack.cpp) as bindings.cpp sees it: handles that hold the classes without
// showing them (and without aten.h, whose torch:: names torch/python.h declares too), so the one file that includes pybind11 does not compile the stack's code, and the stack's
// file does not parse pybind11.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

namespace llmaccel {

struct StackLinear;
class DecodeStack;

// A projection's weights in one of the kernels' layouts (Python: StackLinear).
struct LinearHandle {
  std::shared_ptr<StackLinear> linear;
};

LinearHandle stack_linear(const std::string& kind, at::Tensor weight, c10::optional<at::Tensor> scale,
                          c10::optional<at::Tensor> bias, int64_t n);
LinearHandle fused_linear(std::vector<LinearHandle> parts, c10::optional<at::Tensor> bias);

// Python: DecodeStack.
class DecodeStackHandle {
 public:
  DecodeStackHandle(int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                    at::Tensor final_norm, double scale, double softcap);
  void add_layer(LinearHandle qkv, LinearHandle o, LinearHandle gate_up, LinearHandle down, at::Tensor input_norm,
                 at::Tensor post_norm, int64_t window, c10::optional<at::Tensor> q_norm,
                 c10::optional<at::Tensor> k_norm, c10::optional<at::Tensor> pre_mlp_norm,
                 c10::optional<at::Tensor> post_mlp_norm, c10::optional<at::Tensor> cos,
                 c10::optional<at::Tensor> sin, const std::string& activation);
  at::Tensor forward(at::Tensor hidden, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                        std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches, at::Tensor slots,
                        at::Tensor block_tables, at::Tensor context_lens, int64_t block_size,
                        const std::string& bf16_kernel, bool kv_first,
                        c10::optional<at::Tensor> lora_slots, c10::optional<at::Tensor> stop) const;
  void set_lora(int64_t layer, int64_t index, at::Tensor a, at::Tensor b_t, int64_t share, at::Tensor part_columns);
  int64_t num_layers() const;

 private:
  std::shared_ptr<DecodeStack> stack_;
};

}  // namespace llmaccel
