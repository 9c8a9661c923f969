// Vectorised element-wise reductions used by FTAR's data plane on CPU.
//
// Every rank of a ring runs exactly these kernels on exactly the same inputs
// in exactly the same order, so results are bitwise identical across ranks
// (invariant 1 in the README: identical replicas). Half-precision sums are computed in f32 and rounded
// to nearest-even once, matching numpy/ml_dtypes `(a.astype(f32) + b).astype(h)`.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace fthsdp {

enum class DType : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

// Bytes per element of `dtype`.
size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);

// out[i] = a[i] + b[i] for n elements. `out` may alias `a` or `b` exactly
// (in-place accumulate); partial overlap is undefined.
void reduce_sum(DType dtype, const void* a, const void* b, void* out, size_t n);

}  // namespace fthsdp
