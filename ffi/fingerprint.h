// The state fingerprint's kernel (silent-data-corruption check; the definition and
// why it detects what it must: fthsdp/step/fingerprint.py). Pure: plain data in,
// two words out; the FFI binding (handlers.cc) only decodes buffers into Blocks.
#pragma once

#include <cstdint>
#include <vector>

namespace fthsdp {

// The position constants of the two lanes: word i of leaf k gets the odd multiplier
// 2 * (i * kFpIndexMul[l] + k * kFpLeafMul[l] + kFpOffset[l]) + 1 (mod 2^32) in lane l.
// fthsdp/step/fingerprint.py holds the same numbers (its reference must agree bit for bit).
inline constexpr uint32_t kFpIndexMul[2] = {0x9E3779B1u, 0x7FEB352Du};
inline constexpr uint32_t kFpLeafMul[2] = {0x27D4EB2Fu, 0x846CA68Bu};
inline constexpr uint32_t kFpOffset[2] = {0x165667B1u, 0x5BD1E995u};

// One device's block of one leaf: a row-major local array that starts at `offsets`
// inside a global array of `global_dims` (same rank as `local_dims`).
struct FpBlock {
  const void* data = nullptr;
  int elem_bytes = 4;                 // 1, 2 (zero-extended to a word), 4, or 8 (two words)
  uint32_t leaf = 0;                  // the leaf's index in the state (seeds its multipliers)
  std::vector<int64_t> local_dims;
  std::vector<int64_t> global_dims;
  std::vector<int64_t> offsets;
};

// Adds the blocks' two lane sums into out[0], out[1] (mod 2^32).
void fingerprint_blocks(const std::vector<FpBlock>& blocks, uint32_t out[2]);

}  // namespace fthsdp
