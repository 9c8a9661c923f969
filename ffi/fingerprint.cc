// The state fingerprint's kernel: per word two multiply-adds with position-dependent odd
// multipliers, stepped by addition along each contiguous row (no index arrays), so that a
// whole state costs one pass over its bytes per step.
#include "fingerprint.h"

#include <cstring>

namespace fthsdp {
namespace {

inline uint32_t fold(uint32_t x) { return x ^ (x >> 15); }

// Lane sums over `n` consecutive words whose first has global word index `i0`.
template <typename T>
inline __attribute__((always_inline)) void row_sums(const T* w, int64_t n, uint32_t i0, uint32_t leaf,
                                                     uint32_t* s0, uint32_t* s1) {
  uint32_t c0 = 2u * (i0 * kFpIndexMul[0] + leaf * kFpLeafMul[0] + kFpOffset[0]) + 1u;
  uint32_t c1 = 2u * (i0 * kFpIndexMul[1] + leaf * kFpLeafMul[1] + kFpOffset[1]) + 1u;
  const uint32_t d0 = 2u * kFpIndexMul[0], d1 = 2u * kFpIndexMul[1];
  uint32_t a0 = 0, a1 = 0;
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t x = static_cast<uint32_t>(w[j]);
    a0 += x * c0;
    a1 += fold(x * c1);
    c0 += d0;
    c1 += d1;
  }
  *s0 += a0;
  *s1 += a1;
}

// Compiled for AVX2 and for the baseline ISA; the loader picks one at start-up.
__attribute__((target_clones("avx2", "default"))) void rows_u32(const uint32_t* w, int64_t n, uint32_t i0,
                                                                 uint32_t leaf, uint32_t* s0, uint32_t* s1) {
  row_sums(w, n, i0, leaf, s0, s1);
}
__attribute__((target_clones("avx2", "default"))) void rows_u16(const uint16_t* w, int64_t n, uint32_t i0,
                                                                 uint32_t leaf, uint32_t* s0, uint32_t* s1) {
  row_sums(w, n, i0, leaf, s0, s1);
}
void rows_u8(const uint8_t* w, int64_t n, uint32_t i0, uint32_t leaf, uint32_t* s0, uint32_t* s1) {
  row_sums(w, n, i0, leaf, s0, s1);
}

void block_sums(const FpBlock& b, uint32_t* s0, uint32_t* s1) {
  const int rank = static_cast<int>(b.local_dims.size());
  const uint32_t wpe = b.elem_bytes == 8 ? 2u : 1u;  // words per element
  int64_t row_len = rank == 0 ? 1 : b.local_dims[rank - 1];
  int64_t rows = 1;
  for (int d = 0; d + 1 < rank; ++d) rows *= b.local_dims[d];
  if (row_len == 0 || rows == 0) return;
  // Global (mod 2^32) strides of every axis, in elements.
  std::vector<uint32_t> gstride(rank, 1u);
  for (int d = rank - 2; d >= 0; --d) gstride[d] = gstride[d + 1] * static_cast<uint32_t>(b.global_dims[d + 1]);
  std::vector<int64_t> coord(rank > 0 ? rank - 1 : 0, 0);  // the row's local coordinates
  const char* base = static_cast<const char*>(b.data);
  const int64_t row_bytes = row_len * b.elem_bytes;
  for (int64_t r = 0; r < rows; ++r) {
    uint32_t g = 0;  // the row's first element's global flat index
    for (int d = 0; d < rank; ++d) {
      const int64_t local = d + 1 < rank ? coord[d] : 0;
      g += static_cast<uint32_t>(b.offsets[d] + local) * gstride[d];
    }
    const char* row = base + r * row_bytes;
    const uint32_t i0 = g * wpe;
    switch (b.elem_bytes) {
      case 1: rows_u8(reinterpret_cast<const uint8_t*>(row), row_len, i0, b.leaf, s0, s1); break;
      case 2: rows_u16(reinterpret_cast<const uint16_t*>(row), row_len, i0, b.leaf, s0, s1); break;
      default: rows_u32(reinterpret_cast<const uint32_t*>(row), row_len * wpe, i0, b.leaf, s0, s1); break;
    }
    for (int d = rank - 2; d >= 0; --d) {  // next row
      if (++coord[d] < b.local_dims[d]) break;
      coord[d] = 0;
    }
  }
}

}  // namespace

void fingerprint_blocks(const std::vector<FpBlock>& blocks, uint32_t out[2]) {
  uint32_t s0 = 0, s1 = 0;
  for (const FpBlock& b : blocks) block_sums(b, &s0, &s1);
  out[0] += s0;
  out[1] += s1;
}

}  // namespace fthsdp
