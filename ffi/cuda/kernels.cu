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
//   fork          the queue's side stream waits for that point and runs the
//                 op's reduce worker (2 blocks x 512 threads): it takes the
//                 reduce jobs the control thread posts for every received
//                 reduce-scatter chunk, in post order, and sums
//                 input + received chunk into the pinned staging buffer with
//                 the reduce kernel's loop, until the host raises reduce_stop
//   per block b:  async D2H copy of the block into the pinned staging buffer,
//                 then signal ready[b]=seq
//   per block b:  wait_flag spins (one thread, __nanosleep) until the control
//                 plane raised done[b]=seq, then async H2D copy into the output;
//                 the last wait also writes the status output from pinned memory.
//   join          XLA's stream waits for the side stream's end of the worker.
// The host side runs the ring as soon as the blocks it needs are staged and
// releases blocks as soon as they are final, so the copies in, the network,
// the device's sums and the copies out of different chunks overlap. The
// copies run on the copy engines; the waits use one thread; the sums use two
// thread blocks, so the SMs stay free for compute. Every wait is released by
// the host on success, failure, abort() or deadline, so a dead peer never
// hangs the stream; each also has a device-side backstop (a bug guard).
//
// Why a worker kernel spinning on pinned memory and not cuStreamWaitValue32
// plus one reduce launch per chunk: how many chunks a rank sums depends on
// the ring size, which lives on the device (the quorum arrays) and must not
// be read by the host when the handler enqueues; a worker that takes jobs
// until told to stop runs any number of them from one launch. It also needs
// no stream memory operations (not supported on every driver/GPU), so there
// is no second code path to fall back to.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
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
// outstanding memory operations per thread). One addition per element,
// out = a + b in f32 rounded once: the CPU's reduce_sum (ffi/reduce.cc), so
// a sum made here is bitwise the CPU FTAR's.
template <typename T, int kUnroll = 4>
__device__ void sum_range(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out,
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
__global__ void sum_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out,
                           size_t n) {
  sum_range<T>(a, b, out, n);
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
    return ffi::Error::Internal(std::string("fthsdp reduce_sum (cuda): launching sum_kernel: ") +
                                cudaGetErrorString(err));
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

__device__ inline uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ inline bool reached(uint32_t flag, uint32_t seq) { return static_cast<int32_t>(flag - seq) >= 0; }

constexpr uint64_t kBackstopNs = uint64_t{FTHSDP_DEVICE_BACKSTOP_S} * 1000000000ull;

// Waits for done[b] of op seq; the last wait of an op writes its status. Past
// the backstop it gives up, marks the op and reports FATAL.
__global__ void wait_kernel(FthsdpStagingControl* c, const volatile uint32_t* flag, uint32_t seq,
                            int32_t* status_dst) {
  const uint64_t t0 = now_ns();
  while (!reached(*flag, seq)) {
    if (now_ns() - t0 > kBackstopNs) {
      c->device_timeout = seq;
      break;
    }
    __nanosleep(1000);
  }
  __threadfence_system();
  if (status_dst) {
    *status_dst = c->device_timeout == seq ? FTHSDP_STATUS_FATAL : c->status[seq & 1];
  }
}

struct JobView {
  const void* a;
  const void* b;
  void* out;
  int64_t count;
  int32_t dtype;
};

// The reduce worker of op seq: runs jobs 0, 1, ... of the ring in
// control->jobs until the host raises reduce_stop to seq (or the backstop).
// Thread 0 of each block watches the flags; the whole block sums.
__global__ void reduce_worker(FthsdpStagingControl* c, uint32_t seq) {
  __shared__ int go;  // 1: run `job`, 0: end
  __shared__ JobView job;
  for (uint32_t j = 0;; ++j) {
    FthsdpReduceJob* slot = &c->jobs[j % FTHSDP_REDUCE_SLOTS];
    const uint64_t key = (static_cast<uint64_t>(seq) << 32) | static_cast<uint64_t>(j + 1);
    if (threadIdx.x == 0) {
      const uint64_t t0 = now_ns();
      go = 0;
      for (uint32_t spins = 0;; ++spins) {
        if (slot->key == key) {
          go = 1;
          break;
        }
        if (reached(c->reduce_stop, seq)) break;
        if (now_ns() - t0 > kBackstopNs) {
          c->device_timeout = seq;
          break;
        }
        if (spins > 32) __nanosleep(256);
      }
      __threadfence_system();  // the job's fields were written before its key
      if (go) {
        const volatile FthsdpReduceJob* v = slot;
        job.a = reinterpret_cast<const void*>(v->a);
        job.b = reinterpret_cast<const void*>(v->b);
        job.out = reinterpret_cast<void*>(v->out);
        job.count = v->count;
        job.dtype = v->dtype;
      }
    }
    __syncthreads();
    if (!go) return;
    const size_t n = static_cast<size_t>(job.count);
    switch (job.dtype) {
      case 0: sum_range<float>(static_cast<const float*>(job.a), static_cast<const float*>(job.b), static_cast<float*>(job.out), n); break;
      case 1: sum_range<__nv_bfloat16>(static_cast<const __nv_bfloat16*>(job.a), static_cast<const __nv_bfloat16*>(job.b), static_cast<__nv_bfloat16*>(job.out), n); break;
      default: sum_range<__half>(static_cast<const __half*>(job.a), static_cast<const __half*>(job.b), static_cast<__half*>(job.out), n); break;
    }
    __threadfence_system();  // this thread's sums reach host memory before the flag
    __syncthreads();
    if (threadIdx.x == 0) {
      c->consumed[j % FTHSDP_REDUCE_SLOTS][blockIdx.x] = key;
      __threadfence_system();
    }
    // `job`/`go` are rewritten only by thread 0 after it passed this point;
    // the others are past their reads of them (the __syncthreads above).
  }
}

// CUDA loads a kernel lazily, at its first launch (the default since CUDA
// 12.2), and a load may wait until the context is idle. An all-reduce's
// kernels wait on each other through pinned flags: the reduce worker spins
// on the side stream until the host posts jobs, which needs the signal
// kernels' flags. Left lazy, the first all-reduce of a process launched the
// worker, then the first signal kernel's load waited for the worker to end
// and the worker for that signal: a deadlock broken only by the host's
// deadline (seen on an H200: every first all-reduce came back RECOVERABLE
// after timeout_s). So every kernel of the op is loaded before any of them
// is launched: cudaFuncGetAttributes loads a kernel without running it.
cudaError_t preload_kernels() {
  const void* kernels[] = {
      reinterpret_cast<const void*>(&gather_args_kernel), reinterpret_cast<const void*>(&signal_kernel),
      reinterpret_cast<const void*>(&wait_kernel), reinterpret_cast<const void*>(&reduce_worker)};
  for (const void* k : kernels) {
    cudaFuncAttributes attributes;
    const cudaError_t e = cudaFuncGetAttributes(&attributes, k);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

// Pinned, device-mapped host memory. The kernels use its host address as
// the device address (unified addressing, checked once per queue).
void* pinned_alloc(size_t bytes, void*) {
  void* p = nullptr;
  if (cudaHostAlloc(&p, bytes, cudaHostAllocPortable | cudaHostAllocMapped) != cudaSuccess) return nullptr;
  std::memset(p, 0, bytes);
  return p;
}

void pinned_release(void* p, void*) { (void)cudaFreeHost(p); }

// A queue's device state: the side stream the reduce worker runs on and the
// two events that fork it from and join it to XLA's stream. Owned by the
// staging queue (released with it through release_device).
class SideStream {
 public:
  SideStream() = default;  // empty: use create()
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;
  ~SideStream() {
    if (fork_) (void)cudaEventDestroy(fork_);
    if (join_) (void)cudaEventDestroy(join_);
    if (stream_) (void)cudaStreamDestroy(stream_);
  }
  // nullptr with `error` naming the failed call.
  static std::unique_ptr<SideStream> create(std::string* error) {
    auto s = std::make_unique<SideStream>();
    cudaError_t e = cudaStreamCreateWithFlags(&s->stream_, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&s->fork_, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&s->join_, cudaEventDisableTiming);
    if (e != cudaSuccess) {
      *error = std::string("creating the reduce worker's side stream and events: ") + cudaGetErrorString(e);
      return nullptr;
    }
    return s;
  }
  cudaStream_t stream() const { return stream_; }
  cudaEvent_t fork_event() const { return fork_; }
  cudaEvent_t join_event() const { return join_; }

 private:
  cudaStream_t stream_ = nullptr;
  cudaEvent_t fork_ = nullptr;
  cudaEvent_t join_ = nullptr;
};

// The queue hands back the state it owned (what `create` released to it).
void side_release(void* state, void*) { std::unique_ptr<SideStream>(static_cast<SideStream*>(state)).reset(); }

const FthsdpAllocator kPinned = {pinned_alloc, pinned_release, side_release, nullptr};

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
      return ffi::Error::InvalidArgument(std::string("fthsdp ftar fatal: ") + names[i] +
                                         " must be a single int32, got " +
                                         std::to_string(scalars[i]->element_count()) + " elements");
    }
  }
  if (status->element_count() != 1) {
    return ffi::Error::InvalidArgument("fthsdp ftar fatal: status output must hold one int32");
  }
  if (args.size() != rets.size()) {
    return ffi::Error::InvalidArgument("fthsdp ftar fatal: " + std::to_string(args.size()) +
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
          "fthsdp ftar fatal: buffer " + std::to_string(i) +
          " has an unsupported dtype (supported: float32, bfloat16, float16)");
    }
    if ((*r.value()).element_type() != a.value().element_type() ||
        (*r.value()).element_count() != a.value().element_count()) {
      return ffi::Error::InvalidArgument("fthsdp ftar fatal: output " + std::to_string(i) +
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
  if (e != cudaSuccess) return cuda_error("cudaHostGetDevicePointer (the pinned control block)", e);
  if (ctrl_dev != ctrl) {
    return ffi::Error::Internal(
        "fthsdp ftar (cuda): pinned host memory has a device address different from its host "
        "address (no unified virtual addressing); the reduce worker needs it");
  }
  void** state = api->device_state(q);
  if (!*state) {  // the queue's first op (one queue per stream, so per device)
    e = preload_kernels();
    if (e != cudaSuccess) return cuda_error("loading the all-reduce's kernels", e);
    std::string why;
    std::unique_ptr<SideStream> side = SideStream::create(&why);
    if (!side) return ffi::Error::Internal("fthsdp ftar (cuda): " + why);
    *state = side.release();  // the queue owns it from here (kPinned.release_device)
  }
  const SideStream& side = *static_cast<SideStream*>(*state);
  for (int32_t i = 0; i < nb; ++i) op.bucket_device_in[i] = reinterpret_cast<uint64_t>(in[i]);
  op.seq = api->next_seq(q);

  // 1. The quorum scalars reach the control plane through the stream, never a host read.
  gather_args_kernel<<<1, 1, 0, stream>>>(comm.typed_data(), shard.typed_data(), quorum_id.typed_data(),
                                          rank.typed_data(), num_members.typed_data(), ctrl_dev, op.seq);
  e = cudaGetLastError();
  if (e != cudaSuccess) return cuda_error("launching gather_args", e);  // nothing waits yet
  // From here on the host side owns the op: whatever fails below, its worker
  // releases every wait and ends the reduce worker (reduce_stop), in stream
  // order, by the deadline at the latest.
  if (api->submit(q, &op, err, sizeof(err)) != 0) {  // released FATAL in order; no worker to fork
    return ffi::Error::Internal(std::string("fthsdp ftar fatal: an earlier all-reduce failed fatally: ") + err);
  }
  // Fork: the reduce worker runs beside the copies, on the side stream.
  e = cudaEventRecord(side.fork_event(), stream);
  if (e != cudaSuccess) return cuda_error("cudaEventRecord (fork)", e);
  e = cudaStreamWaitEvent(side.stream(), side.fork_event(), 0);
  if (e != cudaSuccess) return cuda_error("cudaStreamWaitEvent (fork)", e);
  reduce_worker<<<FTHSDP_REDUCE_BLOCKS, 512, 0, side.stream()>>>(ctrl_dev, op.seq);
  e = cudaGetLastError();
  if (e != cudaSuccess) return cuda_error("launching reduce_worker", e);
  e = cudaEventRecord(side.join_event(), side.stream());
  if (e != cudaSuccess) return cuda_error("cudaEventRecord (join)", e);
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
    wait_kernel<<<1, 1, 0, stream>>>(ctrl_dev, &ctrl_dev->done[b], op.seq, last ? status_dev : nullptr);
    e = cudaGetLastError();
    if (e != cudaSuccess) return cuda_error("launching wait", e);
    e = cudaMemcpyAsync(out[blk.bucket] + blk.offset * es,
                        static_cast<const char*>(op.bucket_host[blk.bucket]) + blk.offset * es,
                        static_cast<size_t>(blk.count) * es, cudaMemcpyHostToDevice, stream);
    if (e != cudaSuccess) return cuda_error("copying a block back", e);
  }
  // Join: nothing after the all-reduce runs before its reduce worker ended
  // (so the next op's slots and jobs are never read by this one's worker).
  e = cudaStreamWaitEvent(stream, side.join_event(), 0);
  if (e != cudaSuccess) return cuda_error("cudaStreamWaitEvent (join)", e);
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
