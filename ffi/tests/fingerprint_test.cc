// The fingerprint kernel (ffi/fingerprint.cc) against its definition, written here the slow
// way (one element at a time, its global index from its coordinates), for every copy of
// the kernel this CPU runs (baseline, AVX2, AVX-512): blocks of every element size, ranks
// 0 to 4, split along any axis at any offset, runs shorter and longer than the vectors.
// Exit code 0 = pass.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "fingerprint.h"

namespace {

using fthsdp::FpBlock;
using fthsdp::FpIsa;

int failures = 0;

void check(bool ok, const char* what, int trial) {
  if (!ok) {
    std::fprintf(stderr, "FAIL (trial %d): %s\n", trial, what);
    ++failures;
  }
}

uint32_t fold(uint32_t x) { return x ^ (x >> 15); }
uint32_t premix(uint32_t x) { return x ^ (x >> 16); }

// The definition: word w at global word index i of leaf k adds w * c_0 to lane 0 and
// fold(premix(w) * c_1) to lane 1, c_l = 2 * (i * A_l + k * S_l + B_l) + 1 (mod 2^32).
void reference(const FpBlock& b, uint32_t out[2]) {
  int64_t count = 1;
  for (int d = 0; d < b.rank; ++d) count *= b.local_dims[d];
  const int wpe = b.elem_bytes == 8 ? 2 : 1;
  for (int64_t e = 0; e < count; ++e) {
    int64_t rest = e;
    uint32_t g = 0, stride = 1;
    for (int d = b.rank - 1; d >= 0; --d) {
      const int64_t local = rest % b.local_dims[d];
      rest /= b.local_dims[d];
      g += static_cast<uint32_t>(b.offsets[d] + local) * stride;
      stride *= static_cast<uint32_t>(b.global_dims[d]);
    }
    for (int k = 0; k < wpe; ++k) {
      uint32_t w = 0;
      const char* p = static_cast<const char*>(b.data) + (e * wpe + k) * (b.elem_bytes == 8 ? 4 : b.elem_bytes);
      std::memcpy(&w, p, b.elem_bytes == 8 ? 4 : b.elem_bytes);  // little-endian: zero-extended
      const uint32_t i = g * wpe + k;
      for (int l = 0; l < 2; ++l) {
        const uint32_t c = 2u * (i * fthsdp::kFpIndexMul[l] + b.leaf * fthsdp::kFpLeafMul[l] + fthsdp::kFpOffset[l]) + 1u;
        out[l] += l == 0 ? w * c : fold(premix(w) * c);
      }
    }
  }
}

struct Leaf {
  std::vector<int64_t> local, global;
  std::vector<uint32_t> offsets;
  std::vector<unsigned char> bytes;
};

}  // namespace

int main() {
  std::mt19937 rng(12345);
  const FpIsa isas[] = {FpIsa::kAuto, FpIsa::kBaseline, FpIsa::kAvx2, FpIsa::kAvx512};
  const char* names[] = {"auto", "baseline", "avx2", "avx512"};
  int ran[4] = {0, 0, 0, 0};
  for (int trial = 0; trial < 300; ++trial) {
    const int nleaves = 1 + static_cast<int>(rng() % 5);
    std::vector<Leaf> leaves(nleaves);
    std::vector<FpBlock> blocks;
    for (int k = 0; k < nleaves; ++k) {
      Leaf& L = leaves[k];
      const int rank = static_cast<int>(rng() % 5);
      const int sizes[] = {1, 2, 4, 8};
      const int elem = sizes[rng() % 4];
      int64_t count = 1;
      for (int d = 0; d < rank; ++d) {
        const int64_t global = 1 + rng() % (d + 1 == rank ? 70 : 9);
        // split along this axis now and then: a block at an offset, shorter than the axis
        const int64_t local = rng() % 3 == 0 ? 1 + rng() % global : global;
        L.global.push_back(global);
        L.local.push_back(local);
        L.offsets.push_back(static_cast<uint32_t>(rng() % (global - local + 1)));
        count *= local;
      }
      L.bytes.resize(count * elem);
      for (auto& c : L.bytes) c = static_cast<unsigned char>(rng());
      FpBlock b;
      b.data = L.bytes.data();
      b.elem_bytes = elem;
      b.leaf = static_cast<uint32_t>(k * 7 + trial);
      b.rank = rank;
      b.local_dims = L.local.data();
      b.global_dims = L.global.data();
      b.offsets = L.offsets.data();
      blocks.push_back(b);
    }
    uint32_t want[2] = {0, 0};
    for (const FpBlock& b : blocks) reference(b, want);
    for (int v = 0; v < 4; ++v) {
      uint32_t got[2] = {0, 0};
      if (!fthsdp::fingerprint_blocks(blocks, got, isas[v])) continue;
      ++ran[v];
      check(got[0] == want[0] && got[1] == want[1], names[v], trial);
    }
    // one changed byte anywhere changes both lanes, in every copy
    Leaf& L = leaves[rng() % nleaves];
    if (!L.bytes.empty()) {
      L.bytes[rng() % L.bytes.size()] ^= static_cast<unsigned char>(1u << (rng() % 8));
      for (int v = 0; v < 4; ++v) {
        uint32_t got[2] = {0, 0};
        if (!fthsdp::fingerprint_blocks(blocks, got, isas[v])) continue;
        check(got[0] != want[0] && got[1] != want[1], "a changed byte left a lane unchanged", trial);
      }
    }
  }
  for (int v = 0; v < 4; ++v) std::printf("%s: %d trials\n", names[v], ran[v]);
  check(ran[0] == 300 && ran[1] == 300, "the auto and baseline copies must always run", -1);
  if (failures) {
    std::fprintf(stderr, "%d failures\n", failures);
    return 1;
  }
  std::printf("fingerprint kernel: all copies equal the definition\n");
  return 0;
}
