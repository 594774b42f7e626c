#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm (CPU)");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "Residual add then RMSNorm, in place (CPU)");
  m.def("rotary_embedding", &rotary_embedding, "Rotary embedding of q and k, in place (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up (CPU)");
  m.def("argmax_rows", &argmax_rows, "Row-wise argmax of float32 logits (CPU)");
  m.def("write_kv", &write_kv, "Write new keys and values into the paged KV cache (CPU)");
}
