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

// The highest rank a block may have (the binding refuses more; the Python side uses its
// jax reference for such a state instead).
inline constexpr int kFpMaxRank = 32;

// One device's block of one leaf: a row-major local array that starts at `offsets`
// inside a global array of `global_dims` (same rank as `local_dims`). The three arrays
// are the caller's (views into the FFI call's buffers and attributes: no copies, no
// allocation per leaf), `rank` entries each, valid while fingerprint_blocks runs.
struct FpBlock {
  const void* data = nullptr;
  int elem_bytes = 4;                 // 1, 2 (zero-extended to a word), 4, or 8 (two words)
  uint32_t leaf = 0;                  // the leaf's index in the state (seeds its multipliers)
  int rank = 0;                       // at most kFpMaxRank
  const int64_t* local_dims = nullptr;
  const int64_t* global_dims = nullptr;
  const uint32_t* offsets = nullptr;
};

// Which copy of the kernel runs: the one for the widest vectors the CPU has (what the FFI
// handler runs), or a named one (tests compare them all on one machine).
enum class FpIsa { kAuto, kBaseline, kAvx2, kAvx512 };

// Adds the blocks' two lane sums into out[0], out[1] (mod 2^32). Returns false, adding
// nothing, when `isa` names a copy this CPU (or build) cannot run.
bool fingerprint_blocks(const std::vector<FpBlock>& blocks, uint32_t out[2], FpIsa isa = FpIsa::kAuto);

}  // namespace fthsdp
