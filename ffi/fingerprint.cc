// The state fingerprint's kernel: per word two multiply-adds with position-dependent odd
// multipliers, stepped by addition along each contiguous run of words (no index arrays), so
// that a whole state costs one pass over its bytes per step.
//
// Why it is shaped this way (it runs after every commit, and its budget is 1% of a step):
// * A block's axes are merged from the right while the block spans them whole, so a block
//   split along its first axis is one run of words, however many rows it has (the make-run
//   state's blocks average 80-word rows otherwise, and a per-row start-up would cost more
//   than the words).
// * The sums are kept in N-lane vector accumulators for the whole call and reduced to two
//   words once at the end, not once per row; a run starts with one broadcast add.
// * The loop is written with GCC/Clang vector types, one copy per width: N = 16 (AVX-512),
//   8 (AVX2), 4 (SSE2's and NEON's width, any other CPU). On x86-64 the copy is picked at
//   each call from what the CPU has (one wheel, portable, no -march); ffi/tests/
//   fingerprint_test.cc checks every copy the CPU runs against the definition.
#include "fingerprint.h"

#include <cstring>

// The vector helpers below never cross an ABI boundary (all inline, internal), so GCC's note
// that wide vector returns change the ABI without AVX does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace fthsdp {
namespace {

constexpr int kFoldShift = 15;

inline uint32_t fold(uint32_t x) { return x ^ (x >> kFoldShift); }
// Lane 1 mixes each word before its multiply: a sign flip (bit 31) then changes the product
// in 17 bits, not in bit 31 alone (two such flips cancelled in lane 0 always and in lane 1 half
// the time, so two negated values could leave the fingerprint unchanged).
constexpr int kPremixShift = 16;
inline uint32_t premix(uint32_t x) { return x ^ (x >> kPremixShift); }

// N-lane vectors of words, half-words and bytes, and the load of N consecutive elements
// (unaligned) as zero-extended words. Spelled out per N: GCC 12 does not apply vector_size
// to a type that depends on a template parameter.
template <int N>
struct Vec;
#define FTHSDP_FP_VEC(N)                                                                        \
  template <>                                                                                   \
  struct Vec<N> {                                                                               \
    typedef uint32_t U32 __attribute__((vector_size(N * 4)));                                   \
    typedef uint16_t U16 __attribute__((vector_size(N * 2)));                                   \
    typedef uint8_t U8 __attribute__((vector_size(N)));                                         \
    static inline __attribute__((always_inline)) U32 load(const uint32_t* p) {                  \
      U32 x;                                                                                    \
      std::memcpy(&x, p, sizeof x);                                                             \
      return x;                                                                                 \
    }                                                                                           \
    static inline __attribute__((always_inline)) U32 load(const uint16_t* p) {                  \
      U16 x;                                                                                    \
      std::memcpy(&x, p, sizeof x);                                                             \
      return __builtin_convertvector(x, U32);                                                   \
    }                                                                                           \
    static inline __attribute__((always_inline)) U32 load(const uint8_t* p) {                   \
      U8 x;                                                                                     \
      std::memcpy(&x, p, sizeof x);                                                             \
      return __builtin_convertvector(x, U32);                                                   \
    }                                                                                           \
  };
FTHSDP_FP_VEC(4)
FTHSDP_FP_VEC(8)
FTHSDP_FP_VEC(16)
#undef FTHSDP_FP_VEC

// The two lanes' running sums: vector parts (reduced once, at the end) and scalar parts.
template <int N>
struct Sums {
  typename Vec<N>::U32 v0 = {}, v1 = {};
  uint32_t s0 = 0, s1 = 0;
  // Lane l's multiplier offset from the run's first word, l * d (built once per call: a
  // run's start-up is then one broadcast add per lane, not N inserts; runs are short).
  typename Vec<N>::U32 lane0, lane1;
  Sums() {
    for (int l = 0; l < N; ++l) {
      lane0[l] = static_cast<uint32_t>(l) * (2u * kFpIndexMul[0]);
      lane1[l] = static_cast<uint32_t>(l) * (2u * kFpIndexMul[1]);
    }
  }
};

// Adds `n` consecutive words (zero-extended elements) whose first has multipliers c0, c1.
template <int N, typename T>
inline __attribute__((always_inline)) void run_sums(const T* w, int64_t n, uint32_t c0, uint32_t c1, Sums<N>* s) {
  using U32 = typename Vec<N>::U32;
  const uint32_t d0 = 2u * kFpIndexMul[0], d1 = 2u * kFpIndexMul[1];
  int64_t j = 0;
  if (n >= N) {
    U32 m0 = c0 + s->lane0, m1 = c1 + s->lane1;  // the multipliers of the next N words
    const uint32_t e0 = d0 * N, e1 = d1 * N;
    U32 a0 = s->v0, a1 = s->v1;
    U32 b0 = {}, b1 = {};
    for (; j + 2 * N <= n; j += 2 * N) {
      const U32 x = Vec<N>::load(w + j), y = Vec<N>::load(w + j + N);
      a0 += x * m0;
      const U32 t = (x ^ (x >> kPremixShift)) * m1;
      a1 += t ^ (t >> kFoldShift);
      const U32 n0 = m0 + e0, n1 = m1 + e1;
      b0 += y * n0;
      const U32 u = (y ^ (y >> kPremixShift)) * n1;
      b1 += u ^ (u >> kFoldShift);
      m0 = n0 + e0;
      m1 = n1 + e1;
    }
    for (; j + N <= n; j += N) {
      const U32 x = Vec<N>::load(w + j);
      a0 += x * m0;
      const U32 t = (x ^ (x >> kPremixShift)) * m1;
      a1 += t ^ (t >> kFoldShift);
      m0 += e0;
      m1 += e1;
    }
    a0 += b0;
    a1 += b1;
    s->v0 = a0;
    s->v1 = a1;
    c0 += static_cast<uint32_t>(j) * d0;
    c1 += static_cast<uint32_t>(j) * d1;
  }
  uint32_t b0 = 0, b1 = 0;
  for (; j < n; ++j) {
    const uint32_t x = static_cast<uint32_t>(w[j]);
    b0 += x * c0;
    b1 += fold(premix(x) * c1);
    c0 += d0;
    c1 += d1;
  }
  s->s0 += b0;
  s->s1 += b1;
}

template <int N, typename T>
inline __attribute__((always_inline)) void block_runs(const FpBlock& b, const T* base, Sums<N>* s) {
  const int rank = b.rank;
  const uint32_t wpe = b.elem_bytes == 8 ? 2u : 1u;  // words per element
  // The run: axes k.. of the block, contiguous both locally and globally because every axis
  // after k is whole (local extent == global extent, offset 0).
  int k = rank == 0 ? 0 : rank - 1;
  int64_t run = rank == 0 ? 1 : b.local_dims[rank - 1];
  while (k > 0 && b.local_dims[k] == b.global_dims[k]) run *= b.local_dims[--k];
  int64_t runs = 1;
  for (int d = 0; d < k; ++d) runs *= b.local_dims[d];
  if (run == 0 || runs == 0) return;
  // Global (mod 2^32) strides of every axis, in elements.
  uint32_t gstride[kFpMaxRank];
  if (rank > 0) gstride[rank - 1] = 1u;
  for (int d = rank - 2; d >= 0; --d) gstride[d] = gstride[d + 1] * static_cast<uint32_t>(b.global_dims[d + 1]);
  int64_t coord[kFpMaxRank] = {};  // the run's local coordinates along axes 0..k-1
  const uint32_t leaf0 = 2u * (b.leaf * kFpLeafMul[0] + kFpOffset[0]) + 1u;
  const uint32_t leaf1 = 2u * (b.leaf * kFpLeafMul[1] + kFpOffset[1]) + 1u;
  const int64_t run_elems = run;
  for (int64_t r = 0; r < runs; ++r) {
    uint32_t g = rank == 0 ? 0u : static_cast<uint32_t>(b.offsets[k]) * gstride[k];  // first element's index
    for (int d = 0; d < k; ++d) g += static_cast<uint32_t>(b.offsets[d] + coord[d]) * gstride[d];
    const uint32_t i0 = g * wpe;  // its first word's index
    const T* w = base + r * run_elems * wpe;
    run_sums(w, run_elems * wpe, leaf0 + 2u * i0 * kFpIndexMul[0], leaf1 + 2u * i0 * kFpIndexMul[1], s);
    for (int d = k - 1; d >= 0; --d) {  // the next run
      if (++coord[d] < b.local_dims[d]) break;
      coord[d] = 0;
    }
  }
}

template <int N>
inline __attribute__((always_inline)) void sum_blocks(const FpBlock* blocks, size_t n, uint32_t out[2]) {
  Sums<N> s;
  for (size_t i = 0; i < n; ++i) {
    const FpBlock& b = blocks[i];
    switch (b.elem_bytes) {
      case 1: block_runs(b, static_cast<const uint8_t*>(b.data), &s); break;
      case 2: block_runs(b, static_cast<const uint16_t*>(b.data), &s); break;
      default: block_runs(b, static_cast<const uint32_t*>(b.data), &s); break;  // 4, or 8 as two words
    }
  }
  uint32_t t0 = s.s0, t1 = s.s1;
  for (int l = 0; l < N; ++l) {
    t0 += s.v0[l];
    t1 += s.v1[l];
  }
  out[0] += t0;
  out[1] += t1;
}

// One copy per vector width; on x86-64 the widest the CPU has is picked at each call (the
// check reads a word the C runtime filled at start-up). 4 lanes is SSE2's and NEON's width.
#if defined(__x86_64__) && defined(__GNUC__)
#define FTHSDP_FP_X86 1
__attribute__((target("avx512f"))) void sum_blocks_avx512(const FpBlock* b, size_t n, uint32_t out[2]) {
  sum_blocks<16>(b, n, out);
}
__attribute__((target("avx2"))) void sum_blocks_avx2(const FpBlock* b, size_t n, uint32_t out[2]) {
  sum_blocks<8>(b, n, out);
}
#endif

}  // namespace

bool fingerprint_blocks(const std::vector<FpBlock>& blocks, uint32_t out[2], FpIsa isa) {
  const FpBlock* b = blocks.data();
  const size_t n = blocks.size();
#ifdef FTHSDP_FP_X86
  const bool avx512 = __builtin_cpu_supports("avx512f"), avx2 = __builtin_cpu_supports("avx2");
  if (isa == FpIsa::kAuto) isa = avx512 ? FpIsa::kAvx512 : (avx2 ? FpIsa::kAvx2 : FpIsa::kBaseline);
  switch (isa) {
    case FpIsa::kAvx512:
      if (!avx512) return false;
      sum_blocks_avx512(b, n, out);
      return true;
    case FpIsa::kAvx2:
      if (!avx2) return false;
      sum_blocks_avx2(b, n, out);
      return true;
    default:
      sum_blocks<4>(b, n, out);
      return true;
  }
#else
  if (isa == FpIsa::kAvx2 || isa == FpIsa::kAvx512) return false;
  sum_blocks<4>(b, n, out);
  return true;
#endif
}

}  // namespace fthsdp
