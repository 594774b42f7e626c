// The csrc CPU kernels, one extension module (bindings.cpp); each kernel's contract is at its definition.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale, int64_t window, double softcap,
                                     torch::Tensor sinks);
// How paged_decode_attention runs bf16 prefill rows as tiles: "amx", "avx512_bf16", or "" (row by row).
std::string prefill_tiles();
// Chooses that ("auto": the best the build and CPU allow, "none", "avx512_bf16", "amx"); returns prefill_tiles().
std::string use_prefill_tiles(const std::string& kind);
// Whether the build has the AMX kernels and the CPU (and kernel) let this process use AMX.
bool has_amx();

// Few-row products with AVX-512 BF16 (csrc/gemm_cpu.cpp): the weight packed once, then x W^T (+ bias).
bool pairs_available();
torch::Tensor pack_pairs(torch::Tensor weight);
torch::Tensor linear_pairs(torch::Tensor x, torch::Tensor packed, torch::Tensor bias);

// Batch-invariant bf16 products on AMX tiles (csrc/gemm_amx_cpu.cpp), on pack_pairs' layout; K % 32 == 0;
// where has_amx().
torch::Tensor linear_amx(torch::Tensor x, torch::Tensor packed, torch::Tensor bias);

// Batch-invariant products, float32 or bf16 (csrc/gemm_rows_cpu.cpp): each row's sums in one fixed order.
torch::Tensor pack_rows(torch::Tensor weight);
torch::Tensor linear_rows(torch::Tensor x, torch::Tensor packed, torch::Tensor bias, int64_t out_features);

// Products on GGUF's quantized blocks kept packed (csrc/quant_cpu.cpp): the GGML type ids Q4_0 .. Q6_K.
bool quant_type_supported(int64_t qtype);
torch::Tensor linear_quant(torch::Tensor x, torch::Tensor packed, int64_t qtype, torch::Tensor bias,
                           int64_t out_features, bool amx);
// A product whose runs of output columns are packings of their own types, back to back in one uint8 tensor;
// parts: int64 [P, 4] of (GGML type, first column, columns, byte offset).
torch::Tensor linear_quant_parts(torch::Tensor x, torch::Tensor packed, torch::Tensor parts, torch::Tensor bias,
                                 int64_t out_features);
// linear_quant_parts (or linear_w8a8_parts for W8A8 parts) with an act-order input order: none (empty), one
// [K] every part takes, or [parts, K], each part a product of its own on its order of x (csrc/quant_cpu.cpp).
torch::Tensor linear_blocks(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& parts,
                            const torch::Tensor& bias, const torch::Tensor& order);
// A GGUF weight's blocks in linear_quant's tiles layout (csrc/gguf_pack_cpu.cpp)
torch::Tensor pack_gguf(torch::Tensor raw, int64_t qtype, int64_t n, int64_t k);
torch::Tensor quant_rows(torch::Tensor packed, int64_t qtype, torch::Tensor ids, int64_t in_features,
                         c10::ScalarType dtype);
// W8A8 (csrc/quant_w8a8.cpp): int8 weights (type 104) times each row quantized to int8 per token, summed in int32.
torch::Tensor linear_w8a8_parts(torch::Tensor x, torch::Tensor packed, torch::Tensor parts, torch::Tensor bias,
                                int64_t out_features);
// Int8 activations on packed blocks (csrc/quant_a8.cpp): parts whose type carries the bit 256
// (--activation-quantization int8); linear_quant_a8 one part, reference=True the portable loop.
torch::Tensor linear_a8_parts(torch::Tensor x, torch::Tensor packed, torch::Tensor parts, torch::Tensor bias,
                              int64_t out_features);
torch::Tensor linear_quant_a8(torch::Tensor x, torch::Tensor packed, int64_t qtype, torch::Tensor bias,
                              int64_t out_features, bool reference);

// A mixture-of-experts router's choice per row (csrc/route_cpu.cpp): (ids [T, K] int64, weights [T, K] float32).
std::vector<torch::Tensor> route_experts(torch::Tensor logits, int64_t kind, int64_t top_k, bool renormalize,
                                         double scaling, torch::Tensor score_bias, int64_t groups,
                                         int64_t top_groups);
// A mixture-of-experts layer's experts in one call (csrc/moe_cpu.cpp): grouped by expert, weighted sum back.
torch::Tensor fused_experts(torch::Tensor x, torch::Tensor ids, torch::Tensor weights, torch::Tensor w13,
                            torch::Tensor w2, torch::Tensor b13, torch::Tensor b2, int64_t activation, double alpha,
                            double limit, torch::Tensor shared, torch::Tensor shared_gate);
// The same expert by expert (csrc/moe_loop_cpu.cpp): experts kept as their quantized blocks, and rows whose
// adapter targets the experts (lora: a13, bt13, a2, bt2, row_slots, bounds13, ranks13, bounds2, ranks2);
// orders: act-order blocks' input orders, per expert and part.
torch::Tensor expert_loop(torch::Tensor x, torch::Tensor ids, torch::Tensor weights, torch::Tensor w13,
                          torch::Tensor w2, torch::Tensor b13, torch::Tensor b2, int64_t activation, double alpha,
                          double limit, torch::Tensor shared, torch::Tensor shared_gate,
                          std::optional<std::vector<torch::Tensor>> lora,
                          std::optional<std::vector<torch::Tensor>> orders);

// Bidirectional attention of encoder inputs, each segment of rows by itself (csrc/encoder_attention_cpu.cpp).
torch::Tensor encoder_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor segments,
                                int64_t heads, double scale);

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rotary_embedding(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin,
                      torch::Tensor positions, bool interleaved);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
torch::Tensor gelu_tanh_and_mul(torch::Tensor gate_up);
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor kv_cache, torch::Tensor block_ids,
              torch::Tensor offsets);
torch::Tensor argmax_rows(torch::Tensor logits);
torch::Tensor gather_columns(torch::Tensor x, torch::Tensor order);
// LoRA's products for the rows that use an adapter, added to a fused product's output (csrc/lora_cpu.cpp).
void lora_add(torch::Tensor x, torch::Tensor y, torch::Tensor a, torch::Tensor bt, torch::Tensor row_slots,
              torch::Tensor bounds, torch::Tensor ranks);
std::vector<torch::Tensor> decoder_layers(torch::Tensor x, std::vector<std::vector<torch::Tensor>> layers,
                                          std::vector<torch::Tensor> ropes, std::vector<torch::Tensor> kv_caches,
                                          std::vector<torch::Tensor> pools, std::vector<int64_t> config,
                                          std::vector<int64_t> layer_kinds, std::vector<double> scalars,
                                          std::optional<torch::Tensor> out_rows,
                                          std::optional<std::vector<std::vector<torch::Tensor>>> lora_layers,
                                          std::optional<std::vector<torch::Tensor>> lora_meta);
