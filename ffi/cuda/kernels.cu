// CUDA data plane of FTAR: the element-wise sum kernel, the host-staged
// all-reduce (fthsdp_ftar on the CUDA platform) and their XLA FFI handlers.
// Built only when nvcc is found; loaded by Python only when jax has a GPU
// backend (fthsdp/native.py), which first hands this library the host control
// plane's C table (FthsdpCudaInit): the ring itself is driven by the control
// thread of fthsdp._ffi, never by this library.
//
// fthsdp_ftar on the GPU (the FT-HSDP paper's split, section 4.2; protocol in
// ffi/staging_abi.h): the handler only enqueues work on XLA's stream and
// returns; no host thread waits for the network. Per call, on the stream:
//   gather_args   the five int32 quorum scalars -> pinned args, args_ready=seq
//   per block b:  async D2H copy of the block into the pinned staging buffer,
//                 then signal ready[b]=seq
//   per block b:  wait_flag spins (one thread, __nanosleep) until the control
//                 plane raised done[b]=seq, then async H2D copy into the output;
//                 the last wait also writes the status output from pinned memory.
// The host side reduces over the ring as soon as the blocks it needs are
// staged and releases blocks as soon as they are summed, so the copies in,
// the network and the copies out of different blocks overlap. The kernels use
// one thread each: the copies run on the copy engines and the SMs stay free
// for compute. Every wait is released by the host on success, failure,
// abort() or deadline, so a dead peer never hangs the stream.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "staging_abi.h"
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

// ---------------------------------------------------------------------------
// Host-staged FTAR.

// Written once by FthsdpCudaInit (fthsdp.native) before any handler runs.
std::atomic<const FthsdpHostApi*> g_host_api{nullptr};

__global__ void gather_args_kernel(const int32_t* comm, const int32_t* shard, const int32_t* quorum_id,
                                   const int32_t* rank, const int32_t* n, FthsdpStagingControl* c,
                                   uint32_t seq) {
  c->args[kFthsdpArgComm] = *comm;
  c->args[kFthsdpArgShard] = *shard;
  c->args[kFthsdpArgQuorumId] = *quorum_id;
  c->args[kFthsdpArgRank] = *rank;
  c->args[kFthsdpArgNumMembers] = *n;
  __threadfence_system();  // the args are visible to the host before the flag
  c->args_ready = seq;
  __threadfence_system();
}

__global__ void signal_kernel(volatile uint32_t* flag, uint32_t seq) {
  __threadfence_system();  // the preceding copy completed before this kernel started
  *flag = seq;
  __threadfence_system();
}

__global__ void wait_kernel(const volatile uint32_t* flag, uint32_t seq, const volatile int32_t* status_src,
                            int32_t* status_dst) {
  while (static_cast<int32_t>(*flag - seq) < 0) __nanosleep(1000);
  __threadfence_system();
  if (status_dst) *status_dst = *status_src;
}

void* pinned_alloc(size_t bytes, void*) {
  void* p = nullptr;
  if (cudaHostAlloc(&p, bytes, cudaHostAllocPortable | cudaHostAllocMapped) != cudaSuccess) return nullptr;
  std::memset(p, 0, bytes);
  return p;
}

void pinned_release(void* p, void*) { (void)cudaFreeHost(p); }

const FthsdpAllocator kPinned = {pinned_alloc, pinned_release, nullptr};

bool to_dtype(ffi::DataType t, int32_t* out) {  // fthsdp::DType values
  switch (t) {
    case ffi::DataType::F32: *out = 0; return true;
    case ffi::DataType::BF16: *out = 1; return true;
    case ffi::DataType::F16: *out = 2; return true;
    default: return false;
  }
}

ffi::Error cuda_error(const char* what, cudaError_t err) {
  return ffi::Error::Internal(std::string("fthsdp ftar (cuda): ") + what + ": " + cudaGetErrorString(err));
}

ffi::Error FtarCudaImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> comm, ffi::Buffer<ffi::S32> shard,
                        ffi::Buffer<ffi::S32> quorum_id, ffi::Buffer<ffi::S32> rank,
                        ffi::Buffer<ffi::S32> num_members, ffi::RemainingArgs args,
                        ffi::Result<ffi::Buffer<ffi::S32>> status, ffi::RemainingRets rets) {
  const FthsdpHostApi* api = g_host_api.load(std::memory_order_acquire);
  if (!api) {
    return ffi::Error::Internal(
        "fthsdp ftar (cuda): the CUDA library was not initialised with the host control plane "
        "(call fthsdp.native.ensure_registered(), which runs FthsdpCudaInit)");
  }
  const ffi::Buffer<ffi::S32>* scalars[5] = {&comm, &shard, &quorum_id, &rank, &num_members};
  const char* names[5] = {"comm", "shard", "quorum_id", "rank", "num_members"};
  for (int i = 0; i < 5; ++i) {
    if (scalars[i]->element_count() != 1) {
      return ffi::Error::InvalidArgument(std::string("fthsdp ftar: ") + names[i] +
                                         " must be a single int32, got " +
                                         std::to_string(scalars[i]->element_count()) + " elements");
    }
  }
  if (status->element_count() != 1) {
    return ffi::Error::InvalidArgument("fthsdp ftar: status output must hold one int32");
  }
  if (args.size() != rets.size()) {
    return ffi::Error::InvalidArgument("fthsdp ftar: " + std::to_string(args.size()) +
                                       " buffers in but " + std::to_string(rets.size()) + " out");
  }
  if (args.size() > FTHSDP_MAX_BLOCKS) {
    return ffi::Error::InvalidArgument("fthsdp ftar (cuda): at most " + std::to_string(FTHSDP_MAX_BLOCKS) +
                                       " buckets per call, got " + std::to_string(args.size()));
  }
  const int32_t nb = static_cast<int32_t>(args.size());
  std::vector<const char*> in(nb);
  std::vector<char*> out(nb);
  std::vector<int64_t> counts(nb);
  std::vector<int32_t> dtypes(nb);
  std::vector<size_t> elem(nb);
  size_t total = 0;
  std::vector<size_t> host_off(nb);
  for (int32_t i = 0; i < nb; ++i) {
    auto a = args.get<ffi::AnyBuffer>(i);
    auto r = rets.get<ffi::AnyBuffer>(i);
    if (a.has_error()) return a.error();
    if (r.has_error()) return r.error();
    if (!to_dtype(a.value().element_type(), &dtypes[i])) {
      return ffi::Error::InvalidArgument(
          "fthsdp ftar: buffer " + std::to_string(i) +
          " has an unsupported dtype (supported: float32, bfloat16, float16)");
    }
    if ((*r.value()).element_type() != a.value().element_type() ||
        (*r.value()).element_count() != a.value().element_count()) {
      return ffi::Error::InvalidArgument("fthsdp ftar: output " + std::to_string(i) +
                                         " must match its input's dtype and size");
    }
    in[i] = static_cast<const char*>(a.value().untyped_data());
    out[i] = static_cast<char*>((*r.value()).untyped_data());
    counts[i] = static_cast<int64_t>(a.value().element_count());
    elem[i] = dtypes[i] == 0 ? 4 : 2;
    host_off[i] = total;
    total += (static_cast<size_t>(counts[i]) * elem[i] + 255) & ~size_t{255};
  }
  int32_t* status_dev = status->typed_data();
  FthsdpStagedOp op;
  std::memset(&op, 0, sizeof(op));
  op.num_buckets = nb;
  op.num_blocks = api->plan(nb, counts.data(), dtypes.data(), FTHSDP_MIN_BLOCK_BYTES, op.blocks);
  if (op.num_blocks < 0) return ffi::Error::InvalidArgument("fthsdp ftar (cuda): too many buckets");
  if (op.num_blocks == 0) {  // nothing to sum: status OK
    const cudaError_t e = cudaMemsetAsync(status_dev, 0, sizeof(int32_t), stream);
    return e == cudaSuccess ? ffi::Error::Success() : cuda_error("memset status", e);
  }
  char err[512] = {0};
  void* q = api->queue(reinterpret_cast<uint64_t>(stream), &kPinned, err, sizeof(err));
  if (!q) return ffi::Error::Internal(std::string("fthsdp ftar (cuda): ") + err);
  char* host = static_cast<char*>(api->reserve(q, total, err, sizeof(err)));
  if (!host) return ffi::Error::Internal(std::string("fthsdp ftar (cuda): ") + err);
  for (int32_t i = 0; i < nb; ++i) op.bucket_host[i] = host + host_off[i];
  FthsdpStagingControl* ctrl = api->control(q);
  FthsdpStagingControl* ctrl_dev = nullptr;
  cudaError_t e = cudaHostGetDevicePointer(reinterpret_cast<void**>(&ctrl_dev), ctrl, 0);
  if (e != cudaSuccess) return cuda_error("mapping the pinned control block", e);
  op.seq = api->next_seq(q);

  // 1. The quorum scalars reach the control plane through the stream, never a host read.
  gather_args_kernel<<<1, 1, 0, stream>>>(comm.typed_data(), shard.typed_data(), quorum_id.typed_data(),
                                          rank.typed_data(), num_members.typed_data(), ctrl_dev, op.seq);
  e = cudaGetLastError();
  if (e != cudaSuccess) return cuda_error("launching gather_args", e);  // nothing waits yet
  // From here on the host side owns the op: whatever fails below, its worker
  // releases every wait by the deadline.
  if (api->submit(q, &op, err, sizeof(err)) != 0) {
    return ffi::Error::Internal(std::string("fthsdp ftar: an earlier all-reduce failed fatally: ") + err);
  }
  // 2. Stage the input block by block.
  for (int32_t b = 0; b < op.num_blocks; ++b) {
    const FthsdpStagedBlock& blk = op.blocks[b];
    const size_t es = elem[blk.bucket];
    e = cudaMemcpyAsync(static_cast<char*>(op.bucket_host[blk.bucket]) + blk.offset * es,
                        in[blk.bucket] + blk.offset * es, static_cast<size_t>(blk.count) * es,
                        cudaMemcpyDeviceToHost, stream);
    if (e != cudaSuccess) return cuda_error("staging a block to host", e);
    signal_kernel<<<1, 1, 0, stream>>>(&ctrl_dev->ready[b], op.seq);
    e = cudaGetLastError();
    if (e != cudaSuccess) return cuda_error("launching signal", e);
  }
  // 3. Wait for each summed block and copy it out; the last wait writes the status.
  for (int32_t b = 0; b < op.num_blocks; ++b) {
    const FthsdpStagedBlock& blk = op.blocks[b];
    const size_t es = elem[blk.bucket];
    const bool last = b == op.num_blocks - 1;
    wait_kernel<<<1, 1, 0, stream>>>(&ctrl_dev->done[b], op.seq, &ctrl_dev->status[op.seq & 1],
                                     last ? status_dev : nullptr);
    e = cudaGetLastError();
    if (e != cudaSuccess) return cuda_error("launching wait", e);
    e = cudaMemcpyAsync(out[blk.bucket] + blk.offset * es,
                        static_cast<const char*>(op.bucket_host[blk.bucket]) + blk.offset * es,
                        static_cast<size_t>(blk.count) * es, cudaMemcpyHostToDevice, stream);
    if (e != cudaSuccess) return cuda_error("copying a block back", e);
  }
  return ffi::Error::Success();
}

}  // namespace cuda
}  // namespace fthsdp

// Hands this library the host control plane's C table (from fthsdp._ffi).
// Returns 0, or -1 when the table's ABI differs from this library's.
extern "C" int FthsdpCudaInit(const FthsdpHostApi* api) {
  if (!api || api->abi != FTHSDP_STAGING_ABI) return -1;
  fthsdp::cuda::g_host_api.store(api, std::memory_order_release);
  return 0;
}

// The staging ABI this library was built with (fthsdp.native checks it).
extern "C" int FthsdpCudaStagingAbi() { return FTHSDP_STAGING_ABI; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(FthsdpFtarCuda, fthsdp::cuda::FtarCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // comm
                                  .Arg<ffi::Buffer<ffi::S32>>()  // shard
                                  .Arg<ffi::Buffer<ffi::S32>>()  // quorum_id
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rank
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_members
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::S32>>()  // status
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FthsdpReduceSumCuda, fthsdp::cuda::ReduceSumCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
