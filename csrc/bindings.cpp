#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <mutex>

namespace {

// How many threads one at::parallel_for of this extension runs on: 1 when it was built without OpenMP
// (ATen's parallel_for is header-only and then runs the whole range on the calling thread).
int64_t parallel_threads() {
  std::mutex lock;
  int64_t seen = 0;
  at::parallel_for(0, 1024, 1, [&](int64_t, int64_t) {
    std::lock_guard<std::mutex> guard(lock);
    seen = std::max<int64_t>(seen, at::get_thread_num() + 1);
  });
  return seen;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged attention of decode and prefill rows (CPU)");
  m.def("prefill_tiles", &prefill_tiles, "How bf16 prefill rows run as tiles: 'amx', 'avx512_bf16' or ''");
  m.def("use_prefill_tiles", &use_prefill_tiles, "Choose the prefill tiles ('auto', 'none', 'avx512_bf16', 'amx')");
  m.def("has_amx", &has_amx, "Whether the AMX kernels are built and this CPU runs them");
  m.def("pairs_available", &pairs_available, "Whether linear_pairs is built (AVX-512 BF16)");
  m.def("pack_pairs", &pack_pairs, "A bf16 [N, K] weight in linear_pairs' layout");
  m.def("linear_pairs", &linear_pairs, "x W^T (+ bias) of a few bf16 rows, W from pack_pairs (CPU)");
  m.def("linear_amx", &linear_amx, "x W^T (+ bias) on AMX tiles, the same bits at any row count (CPU)");
  m.def("pack_rows", &pack_rows, "A float32 or bf16 [N, K] weight in linear_rows' layout");
  m.def("linear_rows", &linear_rows, "x W^T (+ bias) with each row's sums in one fixed order (CPU)");
  m.def("quant_type_supported", &quant_type_supported, "Whether linear_quant takes this GGML type");
  m.def("linear_quant", &linear_quant, "x W^T (+ bias) on GGUF blocks kept packed, batch-invariant (CPU)",
        py::arg("x"), py::arg("packed"), py::arg("qtype"), py::arg("bias"), py::arg("out_features"),
        py::arg("amx") = true);
  m.def("linear_quant_parts", &linear_quant_parts, "x W^T (+ bias), W's column runs packed GGUF blocks (CPU)");
  m.def("pack_gguf", &pack_gguf, "A GGUF weight's blocks in linear_quant's tiles layout (CPU)");
  m.def("quant_rows", &quant_rows, "Rows of a packed GGUF weight, dequantized (CPU)");
  m.def("linear_quant_a8", &linear_quant_a8, "x W^T (+ bias) on packed blocks, x quantized to int8 per 32 (CPU)",
        py::arg("x"), py::arg("packed"), py::arg("qtype"), py::arg("bias"), py::arg("out_features"),
        py::arg("reference") = false);
  m.def("linear_w8a8_parts", &linear_w8a8_parts, "x W^T (+ bias), int8 W, x quantized to int8 per row (CPU)");
  m.def("route_experts", &route_experts, "A mixture-of-experts router's experts and weights per row (CPU)");
  m.def("fused_experts", &fused_experts, "A mixture-of-experts layer's experts, grouped by expert (CPU)");
  m.def("expert_loop", &expert_loop, "A mixture-of-experts layer's experts expert by expert: blocks, LoRA (CPU)");
  m.def("encoder_attention", &encoder_attention, "Bidirectional attention of each segment of rows alone (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm (CPU)");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "Residual add then RMSNorm, in place (CPU)");
  m.def("rotary_embedding", &rotary_embedding, "Rotary embedding of q and k, in place (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up (CPU)");
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "GELU(gate, tanh form) * up (CPU)");
  m.def("argmax_rows", &argmax_rows, "Row-wise argmax of float32 or bfloat16 logits (CPU)");
  m.def("gather_columns", &gather_columns, "x[:, order] of a [M, K] tensor (CPU)");
  m.def("lora_add", &lora_add, "y += B_s A_s x for the rows that use LoRA slot s, in place (CPU)");
  m.def("parallel_threads", &parallel_threads, "Threads one parallel_for of these kernels runs on");
  m.def("decoder_layers", &decoder_layers, "The decoder layers of a step whose attention is all paged rows (CPU)");
  m.def("write_kv", &write_kv, "Write new keys and values into the paged KV cache (CPU)");
}
