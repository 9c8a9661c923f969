// The host side of FTAR's GPU data plane: one staging queue per GPU stream
// (protocol and flag layout: ffi/staging_abi.h).
//
// Pure C++ (no CUDA): the CUDA handler library reaches it through the C table
// `fthsdp_host_api()`, and ffi/tests/staging_test.cc drives it on the CPU with
// a thread that plays the GPU stream, which is how the GPU path's protocol
// (flags, slots, release on abort, deadline and dead peers) is tested on
// machines without a GPU.
//
// A queue's worker thread takes the ops in stream order. For each op it waits
// for the stream's args (the quorum scalars), resolves the ring endpoint, and
// runs the ring over the staged bytes as several ring ops cut at multiples of
// the ring's partition size, so that the summation order of every element is
// exactly the CPU FTAR's (bitwise-identical results on CPU and GPU). The
// ring's additions run on the device: the control thread posts every
// received reduce-scatter chunk to the queue's DeviceReducer, whose worker
// kernel sums it into the staging buffer (ffi/staging_reduce.h). A ring op
// starts as soon as the copy blocks it covers are staged; a copy block's
// `done` flag rises as soon as the ring ops covering it finished, so the
// stream's copies in and out, the network and the device's sums of
// different chunks overlap. Every wait has a deadline; any failure stops the
// reduce worker and raises all remaining `done` flags at once.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "control_thread.h"
#include "ring_schedule.h"
#include "staging_abi.h"
#include "staging_reduce.h"

namespace fthsdp {

// How long a queued op may wait for its stream to reach it (the GPU may run a
// long program before the all-reduce). Past it the op is released as
// RECOVERABLE; it is a bug guard, not a network deadline (that is timeout_s,
// counted from the moment the args arrive).
constexpr double kStagingStartWaitS = 3600.0;

// Pure: cut [0, count) into ring ops of multiples of `partition_elems`, each
// about `target_elems` long (at least one partition). The last op takes the
// remainder.
std::vector<Range> cut_ring_ops(int64_t count, int64_t partition_elems, int64_t target_elems);

// Pure: the copy-block plan (see FthsdpHostApi::plan).
int32_t plan_blocks(int32_t num_buckets, const int64_t* counts, const int32_t* dtypes,
                    int64_t min_block_bytes, FthsdpStagedBlock* out);

class StagingQueue {
 public:
  explicit StagingQueue(const FthsdpAllocator& alloc);  // throws std::runtime_error
  ~StagingQueue();  // stops the worker; ops not run yet are released RECOVERABLE
  StagingQueue(const StagingQueue&) = delete;
  StagingQueue& operator=(const StagingQueue&) = delete;

  FthsdpStagingControl* control() { return reinterpret_cast<FthsdpStagingControl*>(control_.get()); }
  // Where the CUDA library keeps its per-stream state (released with the queue).
  void** device_state() { return &device_state_; }
  void* reserve(size_t bytes);  // throws std::runtime_error
  uint32_t next_seq();
  // false (with the reason) when an earlier op failed fatally; the op is then
  // not run, and released with status FATAL when the worker reaches it (in
  // stream order: its reduce worker may not end before the ones ahead of it).
  bool submit(const FthsdpStagedOp& op, std::string* fatal);

  struct Stats {
    int64_t ops_ok = 0;
    int64_t ops_recoverable = 0;
    int64_t ops_fatal = 0;
    int64_t ring_ops = 0;
    int64_t device_reduces = 0;  // chunks summed by the device
    std::string last_error;
  };
  Stats stats();

 private:
  void loop();
  void run(const FthsdpStagedOp& op);
  // Raises done[from..] of `op` after writing its status.
  void release(const FthsdpStagedOp& op, int32_t from, int32_t status, const std::string& reason);
  bool wait_flag(const volatile uint32_t* flag, uint32_t seq, Clock::time_point until);

  FthsdpAllocator alloc_;
  HostBlock control_;  // an FthsdpStagingControl
  void* device_state_ = nullptr;
  std::unique_ptr<DeviceReducer> reducer_;
  std::vector<HostBlock> buffers_;  // data buffers; the last is current

  std::mutex mu_;
  std::condition_variable cv_;
  struct Queued {
    FthsdpStagedOp op;
    std::string refused;  // non-empty: released FATAL with this reason, in stream order
  };
  std::deque<Queued> queue_;
  uint32_t next_seq_ = 1;
  std::string fatal_;  // sticky: reported by the next submit()
  Stats stats_;
  std::atomic<bool> stop_{false};
  std::thread worker_;
};

// The queue of `key` (one per GPU stream), created on first use; owned by the
// communicator registry (ffi/ftar.cc). Throws std::runtime_error.
StagingQueue* ftar_staging_queue(uint64_t key, const FthsdpAllocator& alloc);

}  // namespace fthsdp

extern "C" {
// The table the CUDA handler library is initialised with.
const FthsdpHostApi* fthsdp_host_api(void);
}
