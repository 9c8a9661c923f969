// CUDA data plane of FTAR: the element-wise sum kernel and its XLA FFI handler
// for the CUDA platform. Built only when nvcc is found; loaded by Python only
// when jax has a GPU backend (fthsdp/native.py).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace fthsdp {
namespace cuda {

template <typename T>
__device__ inline float to_f32(T v);
template <> __device__ inline float to_f32<float>(float v) { return v; }
template <> __device__ inline float to_f32<__half>(__half v) { return __half2float(v); }
template <> __device__ inline float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ inline T from_f32(float v);
template <> __device__ inline float from_f32<float>(float v) { return v; }
template <> __device__ inline __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <> __device__ inline __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Grid-stride loop with several independent loads per thread in flight (the
// paper's instruction-level parallelism at low occupancy: few blocks, many
// outstanding memory operations per thread).
template <typename T, int kUnroll = 4>
__global__ void sum_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out,
                           size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + (kUnroll - 1) * stride < n; i += kUnroll * stride) {
    float va[kUnroll], vb[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      va[u] = to_f32(a[i + u * stride]);
      vb[u] = to_f32(b[i + u * stride]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) out[i + u * stride] = from_f32<T>(va[u] + vb[u]);
  }
  for (; i < n; i += stride) out[i] = from_f32<T>(to_f32(a[i]) + to_f32(b[i]));
}

template <typename T>
cudaError_t launch_sum(cudaStream_t stream, const void* a, const void* b, void* out, size_t n) {
  constexpr int kThreads = 512;  // the paper's FTAR: 2 blocks x 512 threads
  constexpr int kBlocks = 2;
  sum_kernel<T><<<kBlocks, kThreads, 0, stream>>>(static_cast<const T*>(a),
                                                  static_cast<const T*>(b), static_cast<T*>(out), n);
  return cudaGetLastError();
}

ffi::Error ReduceSumCudaImpl(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                             ffi::Result<ffi::AnyBuffer> out) {
  if (b.element_type() != a.element_type() || out->element_type() != a.element_type() ||
      b.element_count() != a.element_count() || out->element_count() != a.element_count()) {
    return ffi::Error::InvalidArgument("fthsdp reduce_sum (cuda): operands must match in dtype and size");
  }
  const size_t n = a.element_count();
  cudaError_t err;
  switch (a.element_type()) {
    case ffi::DataType::F32: err = launch_sum<float>(stream, a.untyped_data(), b.untyped_data(), out->untyped_data(), n); break;
    case ffi::DataType::BF16: err = launch_sum<__nv_bfloat16>(stream, a.untyped_data(), b.untyped_data(), out->untyped_data(), n); break;
    case ffi::DataType::F16: err = launch_sum<__half>(stream, a.untyped_data(), b.untyped_data(), out->untyped_data(), n); break;
    default:
      return ffi::Error::InvalidArgument("fthsdp reduce_sum (cuda): unsupported dtype");
  }
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("fthsdp reduce_sum (cuda): ") + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

}  // namespace cuda
}  // namespace fthsdp

XLA_FFI_DEFINE_HANDLER_SYMBOL(FthsdpReduceSumCuda, fthsdp::cuda::ReduceSumCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
