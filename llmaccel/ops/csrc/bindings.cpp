// The Python module of llmaccel's CPU kernels. The only file that includes pybind11 and torch's Python
// headers (the kernels' own need only aten.h), and the same for every instruction-set level: setup.py
// compiles it once and links it into each level's library, whose module.cpp names the module.
#include <pybind11/stl.h>
#include <torch/python.h>

#include "decode_stack.h"

// module.cpp's, one per build: its instruction-set level and its sources' digest
extern const char* const llmaccel_kernel_level;
extern const char* const llmaccel_build_id;

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     int64_t block_size, int64_t window, double scale, double softcap);
torch::Tensor gemv_i8(torch::Tensor x, torch::Tensor blocks, c10::optional<torch::Tensor> row_scale, int64_t n);
torch::Tensor gemv_i4(torch::Tensor x, torch::Tensor blocks, int64_t n);
torch::Tensor gemv_kq(torch::Tensor x, torch::Tensor blocks, int64_t kind, int64_t n);
torch::Tensor gguf_repack(torch::Tensor raw, int64_t type, torch::Tensor rows, int64_t k,
                          c10::optional<torch::Tensor> out);
bool gemv_vectorized();
torch::Tensor int8_rows(torch::Tensor blocks, c10::optional<torch::Tensor> row_scale, torch::Tensor ids);
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps);
void rope_(torch::Tensor qk, int64_t heads, int64_t head_dim, torch::Tensor positions, torch::Tensor cos,
           torch::Tensor sin);
torch::Tensor silu_mul(torch::Tensor gate_up);
void lora_add_(torch::Tensor y, torch::Tensor x, torch::Tensor a, torch::Tensor b_t, torch::Tensor slots,
               int64_t share, torch::Tensor part_columns);
torch::Tensor gelu_tanh_mul(torch::Tensor gate_up);
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slots);
torch::Tensor fused_decode_attention(torch::Tensor qkv, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                     torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                                     torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                                     torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size,
                                     int64_t window, double scale, double softcap);
torch::Tensor linear_f32(torch::Tensor x, torch::Tensor panels, int64_t n);
torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor w);
torch::Tensor gemm_bf16(torch::Tensor x, torch::Tensor w);
bool gemm_bf16_available();
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                                int64_t window, double scale);
bool prefill_attention_available();
torch::Tensor pack_vnni(torch::Tensor w);
torch::Tensor pack_bf16_compact(torch::Tensor w, c10::optional<torch::Tensor> into);
torch::Tensor unpack_bf16_compact(torch::Tensor packed, c10::optional<torch::Tensor> ids);
torch::Tensor linear_bf16_compact(torch::Tensor x, torch::Tensor packed, bool gemm);
bool bf16_compact_available();
torch::Tensor linear_vnni(torch::Tensor x, torch::Tensor packed, int64_t n, const std::string& kernel);
bool vnni_available();
bool quant_amx_available();
torch::Tensor quant_linear_amx(torch::Tensor x, torch::Tensor blocks, c10::optional<torch::Tensor> row_scale,
                               int64_t n, bool int4);
torch::Tensor kquant_linear_amx(torch::Tensor x, torch::Tensor blocks, int64_t kind, int64_t n);
torch::Tensor argmax_rows(torch::Tensor logits);
std::vector<torch::Tensor> sample_rows(torch::Tensor logits, torch::Tensor temperature, torch::Tensor top_k,
                                       torch::Tensor top_p, torch::Tensor min_p, torch::Tensor uniform);
void mask_rows_(torch::Tensor logits, torch::Tensor rows, torch::Tensor masks);

static void bind_decode_stack(pybind11::module& m) {
  namespace py = pybind11;
  using llmaccel::DecodeStackHandle;
  using llmaccel::LinearHandle;
  // module_local: two builds of these kernels in one process (the tests load each level's beside the
  // native one) would otherwise register the same C++ types twice
  py::class_<LinearHandle>(m, "StackLinear", py::module_local());
  m.def("stack_linear", &llmaccel::stack_linear,
        "a projection's weights for DecodeStack: kind f32 (panels), bf16, bf16_vnni, int8, int4, q4_k, q5_k or q6_k",
        py::arg("kind"), py::arg("weight"), py::arg("scale"), py::arg("bias"), py::arg("n"));
  m.def("fused_linear", &llmaccel::fused_linear, "one projection from parts in different layouts, side by side",
        py::arg("parts"), py::arg("bias"));
  py::class_<DecodeStackHandle>(m, "DecodeStack", py::module_local())
      .def(py::init<int64_t, int64_t, int64_t, int64_t, double, torch::Tensor, double, double>())
      .def("add_layer", &DecodeStackHandle::add_layer, py::arg("qkv"), py::arg("o"), py::arg("gate_up"),
           py::arg("down"), py::arg("input_norm"), py::arg("post_norm"), py::arg("window"),
           py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(), py::arg("pre_mlp_norm") = py::none(),
           py::arg("post_mlp_norm") = py::none(), py::arg("cos") = py::none(), py::arg("sin") = py::none(),
           py::arg("activation") = "silu")
      .def("forward", &DecodeStackHandle::forward, py::arg("hidden"), py::arg("positions"), py::arg("cos"),
           py::arg("sin"), py::arg("k_caches"), py::arg("v_caches"), py::arg("slots"), py::arg("block_tables"),
           py::arg("context_lens"), py::arg("block_size"), py::arg("bf16_kernel"), py::arg("kv_first"),
           py::arg("lora_slots") = py::none(), py::arg("stop") = py::none(),
           py::call_guard<py::gil_scoped_release>())
      .def("set_lora", &DecodeStackHandle::set_lora,
           "LoRA adapters for layer `layer`'s projection `index` (0 qkv, 1 o, 2 gate_up, 3 down): lora/layers.py's "
           "stacked a and b_t, held as they are", py::arg("layer"), py::arg("index"), py::arg("a"), py::arg("b_t"),
           py::arg("share"), py::arg("part_columns"))
      .def_property_readonly("num_layers", &DecodeStackHandle::num_layers);
}

// Every entry point lets go of the GIL while it runs, as torch's own operators do: a decode step
// spends milliseconds here, and the server's event loop (streaming the last step's tokens, taking
// new requests) runs meanwhile instead of waiting for the step to end (one lone request +4%,
// 64 at once +2%: medians of paired runs on 2 cores).
// Python finds a build by its own name (module.cpp's PyInit__kernels_avx2, ...), which calls this one; a
// module created in phases takes its name from the import, not from here.
PYBIND11_MODULE(_kernels, m) {
  namespace py = pybind11;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("block_size"),
        py::arg("window"), py::arg("scale"), py::arg("softcap") = 0.0, nogil);
  m.def("gemv_i8", &gemv_i8, "x @ w.T, INT8 weights in 16-row blocks of 32 inputs, INT8 activations", nogil);
  m.def("int8_rows", &int8_rows, "rows of an INT8 weight held in gemv_i8's blocks, dequantized (an embedding lookup)",
        nogil);
  m.def("gemv_i4", &gemv_i4, "x @ w.T, INT4 weights in 16-row blocks of 32 inputs, INT8 activations", nogil);
  m.def("gemv_kq", &gemv_kq, "x @ w.T, llama.cpp K-quant weights (Q4_K/Q5_K/Q6_K) in 16-row blocks, INT8 activations",
        nogil);
  m.def("gguf_repack", &gguf_repack, "a GGUF tensor's Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K bytes -> the kernels' blocks",
        py::arg("raw"), py::arg("type"), py::arg("rows"), py::arg("k"), py::arg("out") = py::none(), nogil);
  m.def("write_kv", &write_kv, "new keys and values into the paged KV pool at their slots", nogil);
  m.def("fused_decode_attention", &fused_decode_attention, "RoPE, KV write and paged attention of a decode step",
        py::arg("qkv"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("positions"),
        py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"),
        py::arg("block_tables"), py::arg("context_lens"), py::arg("block_size"), py::arg("window"), py::arg("scale"),
        py::arg("softcap") = 0.0, nogil);
  m.def("linear_f32", &linear_f32, "x @ w.T, float32 weights in panels of 16 columns, any row count", nogil);
  m.def("gemv_bf16", &gemv_bf16, "x @ w.T for few rows, bfloat16 weights in their plain layout, float32 sums", nogil);
  m.def("gemm_bf16", &gemm_bf16, "x @ w.T for bfloat16 batches on AVX512-BF16, w in its plain layout", nogil);
  m.def("gemm_bf16_available", &gemm_bf16_available, "whether the AVX512-BF16 GEMM was compiled in", nogil);
  m.def("prefill_attention", &prefill_attention,
        "a prefill chunk's attention over its context in the paged pool, bfloat16 on AVX512-BF16", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"), py::arg("window"), py::arg("scale"), nogil);
  m.def("prefill_attention_available", &prefill_attention_available,
        "whether the bfloat16 prefill attention was compiled in (it needs AVX512-BF16)", nogil);
  m.def("pack_vnni", &pack_vnni, "bfloat16 [N, K] -> blocks of 32 columns [N / 32, K / 2, 32, 2] (AMX pairs)", nogil);
  m.def("pack_bf16_compact", &pack_bf16_compact,
        "bfloat16 [N, K] (K % 64 == 0) -> the compact layout: 12 bits a weight, lossless (uint8 tensor); written "
        "at the front of `into` where given",
        py::arg("w"), py::arg("into") = py::none(), nogil);
  m.def("unpack_bf16_compact", &unpack_bf16_compact, "a compact weight's rows `ids` (or all) as bfloat16 [*, K]",
        py::arg("packed"), py::arg("ids") = py::none(), nogil);
  m.def("linear_bf16_compact", &linear_bf16_compact,
        "x @ w.T for bfloat16 x and a compact weight: float32 sums by the streaming kernel, or with gemm=True "
        "bfloat16 by the GEMM", py::arg("x"), py::arg("packed"), py::arg("gemm"), nogil);
  m.def("bf16_compact_available", &bf16_compact_available,
        "whether the compact bf16 kernels were compiled in (they need AVX512-BF16)", nogil);
  m.def("linear_vnni", &linear_vnni, "x @ w.T for bfloat16 weights packed by pack_vnni: vnni_stream or brgemm",
        nogil);
  m.def("vnni_available", &vnni_available, "whether the packed bfloat16 kernels (AMX brgemm) run here", nogil);
  m.def("quant_amx_available", &quant_amx_available,
        "whether the AMX kernel for INT8/INT4/K-quant weights runs here (an AMX build and CPU)", nogil);
  m.def("quant_linear_amx", &quant_linear_amx,
        "x @ w.T for bfloat16 x and INT8/INT4 weights in gemv's blocks, dequantized to bf16 for AMX tiles", nogil);
  m.def("kquant_linear_amx", &kquant_linear_amx,
        "x @ w.T for bfloat16 x and K-quant weights (Q4_K/Q5_K/Q6_K records), dequantized to bf16 for AMX tiles",
        nogil);
  m.def("rms_norm", &rms_norm, "RMSNorm of rows, the residual added in place first if given", nogil);
  m.def("rope_", &rope_, "rotate-half RoPE of the first heads of each row, in place", nogil);
  m.def("silu_mul", &silu_mul, "silu(gate) * up of [T, 2I] rows", nogil);
  m.def("lora_add_", &lora_add_, "y += each row's LoRA delta B_s A_s x in place (lora/layers.py's stacked adapters)",
        py::arg("y"), py::arg("x"), py::arg("a"), py::arg("b_t"), py::arg("slots"), py::arg("share"),
        py::arg("part_columns"), nogil);
  m.def("gelu_tanh_mul", &gelu_tanh_mul, "gelu_tanh(gate) * up of [T, 2I] rows (GeGLU)", nogil);
  m.def("argmax_rows", &argmax_rows, "first index of each row's largest value (NaN first), rows in parallel", nogil);
  m.def("sample_rows", &sample_rows, "one draw per row: temperature, top-k, top-p, min-p, inverse CDF", nogil);
  m.def("mask_rows_", &mask_rows_, "grammar bitmasks onto rows of logits, in place (-inf where a bit is clear)",
        nogil);
  bind_decode_stack(m);
  m.attr("build_id") = llmaccel_build_id;  // names the build in caches of what was timed with it
  m.attr("level") = llmaccel_kernel_level;
  m.def("gemv_vectorized", &gemv_vectorized, "whether the AVX2 paths were compiled in", nogil);
}
