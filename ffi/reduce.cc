#include "reduce.h"

#include <cstring>

// Each loop is compiled twice (baseline x86-64 and Haswell: AVX2 + F16C) and
// the best one is picked at load time through an ifunc, so one wheel runs
// everywhere and still uses 256-bit vectors where the CPU has them.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FTHSDP_MULTIVERSION __attribute__((target_clones("arch=haswell", "default")))
#else
#define FTHSDP_MULTIVERSION
#endif

namespace fthsdp {
namespace {

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  // NaN must stay NaN (the rounding add below could carry it into Inf).
  const uint32_t nan_mask = ((bits & 0x7fffffffu) > 0x7f800000u) ? 0xffffffffu : 0u;
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x0040u;
  return static_cast<uint16_t>((rounded & ~nan_mask) | (quiet_nan & nan_mask));
}

FTHSDP_MULTIVERSION
void sum_f32(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ out,
             size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

FTHSDP_MULTIVERSION
void sum_bf16(const uint16_t* __restrict__ a, const uint16_t* __restrict__ b,
              uint16_t* __restrict__ out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
}

#if defined(__FLT16_MAX__)
FTHSDP_MULTIVERSION
void sum_f16(const _Float16* __restrict__ a, const _Float16* __restrict__ b,
             _Float16* __restrict__ out, size_t n) {
  for (size_t i = 0; i < n; ++i)
    out[i] = static_cast<_Float16>(static_cast<float>(a[i]) + static_cast<float>(b[i]));
}
#else
#error "fthsdp needs a compiler with _Float16 (GCC >= 12 or Clang >= 15 on x86-64/aarch64)"
#endif

// The __restrict__ kernels require no aliasing; in-place accumulation aliases
// out with an input. Elementwise kernels read a[i] before writing out[i], so
// exact aliasing is safe in practice, but we dispatch to a small temporary-free
// path through a block copy to keep the restrict contract honest.
template <typename T, typename F>
void dispatch(const void* a, const void* b, void* out, size_t n, F kernel) {
  const T* pa = static_cast<const T*>(a);
  const T* pb = static_cast<const T*>(b);
  T* po = static_cast<T*>(out);
  if (po != pa && po != pb) {
    kernel(pa, pb, po, n);
    return;
  }
  constexpr size_t kBlock = 4096;
  alignas(64) T tmp[kBlock];
  for (size_t off = 0; off < n; off += kBlock) {
    const size_t m = (n - off < kBlock) ? n - off : kBlock;
    kernel(pa + off, pb + off, tmp, m);
    std::memcpy(po + off, tmp, m * sizeof(T));
  }
}

}  // namespace

size_t dtype_size(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
  }
  return "?";
}

void reduce_sum(DType dtype, const void* a, const void* b, void* out, size_t n) {
  switch (dtype) {
    case DType::kF32: dispatch<float>(a, b, out, n, sum_f32); return;
    case DType::kBF16: dispatch<uint16_t>(a, b, out, n, sum_bf16); return;
    case DType::kF16: dispatch<_Float16>(a, b, out, n, sum_f16); return;
  }
}

}  // namespace fthsdp
