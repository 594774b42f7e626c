// pack_gguf(raw [N, K / B * block bytes] uint8, qtype, N, K) -> [N / 16, K / B, record] uint8: a GGUF weight's
// blocks in the tiles layout linear_quant reads, the same bytes as worker/quant/gguf_pack.py's numpy `pack`
// (its docstring has the record's fields; tests/test_kernels_quant.py checks every type byte for byte). The
// numpy form is the specification; this one runs at a worker's start, where the numpy one took 0.3 s of
// SmolLM2's 1.9 s (docs/operations.md#startup).
#include <ATen/Parallel.h>

#include <cstring>

#include "ops.h"

namespace {

// GGML's type numbers (csrc/quant_blocks.h's QType, whose header defines functions of quant_cpu.cpp)
namespace QType {
constexpr int64_t Q2_K = 10, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14;
}

struct Layout {
  int64_t block, bytes, record;
};

Layout layout_of(int64_t qtype) {
  switch (qtype) {
    case QType::Q2_K: return {256, 84, 2624};
    case QType::Q4_0: return {32, 18, 288};
    case QType::Q4_1: return {32, 20, 320};
    case QType::Q5_0: return {32, 22, 352};
    case QType::Q5_1: return {32, 24, 384};
    case QType::Q8_0: return {32, 34, 544};
    case QType::Q4_K: return {256, 144, 2368};
    case QType::Q5_K: return {256, 176, 2880};
    case QType::Q6_K: return {256, 210, 3360};
    default: TORCH_CHECK(false, "pack_gguf: GGML type ", qtype, " is not one of ours");
  }
  return {};
}

// One row's block: its integers q[0 .. B) (the stored values, as gguf.quants reads them) and the per-row
// fields of the record, each a run of `width` bytes that the record holds for the 16 rows side by side.
struct Fields {
  const uint8_t* at[4];
  int64_t width[4];
  int count = 0;
  void add(const uint8_t* p, int64_t w) { at[count] = p, width[count] = w, ++count; }
};

// Q4_K / Q5_K's 6-bit scales and mins from their 12 bytes (llama.cpp's get_scale_min_k4)
void scale_min_k4(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63, mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 2) & 48);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 48);
  }
}

void block_values(int64_t qtype, const uint8_t* b, uint8_t* q, Fields& f, uint8_t* scratch) {
  switch (qtype) {
    case QType::Q4_0:
    case QType::Q4_1: {
      const int64_t first = qtype == QType::Q4_0 ? 2 : 4;
      f.add(b, 2);
      if (qtype == QType::Q4_1) f.add(b + 2, 2);
      for (int j = 0; j < 16; ++j) q[j] = b[first + j] & 15, q[j + 16] = b[first + j] >> 4;
      return;
    }
    case QType::Q5_0:
    case QType::Q5_1: {
      const int64_t at = qtype == QType::Q5_0 ? 2 : 4;
      f.add(b, 2);
      if (qtype == QType::Q5_1) f.add(b + 2, 2);
      uint32_t qh;
      std::memcpy(&qh, b + at, 4);
      for (int j = 0; j < 16; ++j) {
        q[j] = (b[at + 4 + j] & 15) | (((qh >> j) & 1) << 4);
        q[j + 16] = (b[at + 4 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      }
      return;
    }
    case QType::Q8_0:
      f.add(b, 2);
      std::memcpy(q, b + 2, 32);
      return;
    case QType::Q4_K:
    case QType::Q5_K: {
      f.add(b, 2), f.add(b + 2, 2);
      scale_min_k4(b + 4, scratch, scratch + 8);
      f.add(scratch, 8), f.add(scratch + 8, 8);
      const uint8_t* qs = b + (qtype == QType::Q4_K ? 16 : 48);
      for (int j = 0; j < 8; ++j)
        for (int l = 0; l < 32; ++l) {
          uint8_t v = (qs[(j / 2) * 32 + l] >> ((j % 2) * 4)) & 15;
          if (qtype == QType::Q5_K) v |= ((b[16 + l] >> j) & 1) << 4;
          q[j * 32 + l] = v;
        }
      return;
    }
    case QType::Q2_K: {  // 16 bytes of (min << 4 | scale), 64 of 2-bit values, d, dmin
      f.add(b + 80, 2), f.add(b + 82, 2);
      for (int j = 0; j < 16; ++j) scratch[j] = b[j] & 15, scratch[16 + j] = b[j] >> 4;
      f.add(scratch, 16), f.add(scratch + 16, 16);
      for (int i = 0; i < 256; ++i) q[i] = (b[16 + (i / 128) * 32 + i % 32] >> (((i % 128) / 32) * 2)) & 3;
      return;
    }
    case QType::Q6_K: {
      f.add(b + 208, 2), f.add(b + 192, 16);
      for (int i = 0; i < 256; ++i) {
        const int h = i / 128, r = i % 128;
        const uint8_t low = (b[h * 64 + r % 64] >> ((r / 64) * 4)) & 15;
        const uint8_t high = (b[128 + h * 32 + r % 32] >> ((r / 32) * 2)) & 3;
        q[i] = low | (high << 4);
      }
      return;
    }
    default: TORCH_CHECK(false, "pack_gguf: GGML type ", qtype, " is not one of ours");
  }
}

}  // namespace

torch::Tensor pack_gguf(torch::Tensor raw, int64_t qtype, int64_t n, int64_t k) {
  const Layout lay = layout_of(qtype);
  TORCH_CHECK(raw.scalar_type() == torch::kUInt8 && raw.is_contiguous(), "pack_gguf: raw is contiguous uint8");
  TORCH_CHECK(n % 16 == 0 && k % lay.block == 0, "pack_gguf: N a multiple of 16 and K of ", lay.block);
  const int64_t nb = k / lay.block;
  TORCH_CHECK(raw.numel() == n * nb * lay.bytes, "pack_gguf: raw holds ", raw.numel(), " bytes, not ",
              n * nb * lay.bytes);
  auto out = torch::empty({n / 16, nb, lay.record}, torch::kUInt8);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int high_bits = (qtype == QType::Q5_0 || qtype == QType::Q5_1 || qtype == QType::Q5_K) ? 1
                        : qtype == QType::Q6_K                                                  ? 2
                                                                                                : 0;
  at::parallel_for(0, (n / 16) * nb, 16, [&](int64_t begin, int64_t end) {
    uint8_t q[16][256], scratch[16][32];
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t g = unit / nb, blk = unit % nb;
      uint8_t* rec = dst + unit * lay.record;
      if (qtype == QType::Q4_0 || qtype == QType::Q4_1) {  // the common case straight from the bytes (2.7x sooner)
        const uint8_t* b[16];
        for (int c = 0; c < 16; ++c) b[c] = src + ((g * 16 + c) * nb + blk) * lay.bytes;
        const int first = qtype == QType::Q4_0 ? 2 : 4;  // d (and m), f16 each, then 16 bytes of nibbles
        for (int at = 0; at < first; at += 2, rec += 32)
          for (int c = 0; c < 16; ++c) std::memcpy(rec + c * 2, b[c] + at, 2);
        for (int p = 0; p < 8; ++p)  // dims 2p, 2p + 1: the low nibbles of bytes 2p, 2p + 1
          for (int c = 0; c < 16; ++c)
            rec[p * 16 + c] = static_cast<uint8_t>((b[c][first + 2 * p] & 15) | (b[c][first + 2 * p + 1] << 4));
        for (int p = 0; p < 8; ++p)  // dims 16 + 2p, 17 + 2p: their high nibbles
          for (int c = 0; c < 16; ++c)
            rec[(8 + p) * 16 + c] = static_cast<uint8_t>((b[c][first + 2 * p] >> 4) | (b[c][first + 2 * p + 1] & 0xF0));
        continue;
      }
      Fields fields[16];
      for (int c = 0; c < 16; ++c)
        block_values(qtype, src + ((g * 16 + c) * nb + blk) * lay.bytes, q[c], fields[c], scratch[c]);
      // the fields: each a run of width bytes per row -> [width / item items][16 rows][item bytes]; the f16
      // scales are items of 2 bytes, the scale bytes items of 1
      for (int i = 0; i < fields[0].count; ++i) {
        const int64_t width = fields[0].width[i], item = width == 2 ? 2 : 1;
        for (int64_t j = 0; j < width / item; ++j)
          for (int c = 0; c < 16; ++c) std::memcpy(rec + (j * 16 + c) * item, fields[c].at[i] + j * item, item);
        rec += width * 16;
      }
      if (qtype == QType::Q8_0) {  // [B / 2 dim pairs][16 rows][2]
        for (int64_t p = 0; p < lay.block / 2; ++p)
          for (int c = 0; c < 16; ++c) rec[(p * 16 + c) * 2] = q[c][2 * p], rec[(p * 16 + c) * 2 + 1] = q[c][2 * p + 1];
        continue;
      }
      for (int64_t p = 0; p < lay.block / 2; ++p)  // [B / 2][16]: dim 2p in the low nibble, 2p + 1 in the high
        for (int c = 0; c < 16; ++c) rec[p * 16 + c] = (q[c][2 * p] & 15) | ((q[c][2 * p + 1] & 15) << 4);
      rec += lay.block / 2 * 16;
      if (high_bits == 0) continue;
      const uint32_t mask = (1u << high_bits) - 1;
      for (int64_t d = 0; d < lay.block; ++d) {  // per dim: bit (c * high_bits) on, row c's top bits
        uint32_t bits = 0;
        for (int c = 0; c < 16; ++c) bits |= ((static_cast<uint32_t>(q[c][d]) >> 4) & mask) << (c * high_bits);
        if (high_bits == 1) {
          const uint16_t half = static_cast<uint16_t>(bits);
          std::memcpy(rec + d * 2, &half, 2);
        } else {
          std::memcpy(rec + d * 4, &bits, 4);
        }
      }
    }
  });
  return out;
}
