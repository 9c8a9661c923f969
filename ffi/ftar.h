// FTAR's entry points above the control thread: the communicator registry
// (the one global of the library) and the all-reduce of a list of buffers
// that the XLA FFI handler and the host API share.
//
// A communicator is a group of ring endpoints, one per local shard: shard i
// of this replica forms a ring with shard i of every other replica, so the
// local device programs that XLA runs concurrently never share a ring and
// cannot deadlock on each other. Python holds only the small integer handle
// and passes it into the jitted step as an int32 array.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "control_thread.h"

namespace fthsdp {

class Communicator {
 public:
  Communicator(int num_shards, const RingOptions& options, std::shared_ptr<ControlThread> thread);
  ~Communicator();

  int num_shards() const { return static_cast<int>(shards_.size()); }
  // One listen address per shard.
  std::vector<std::string> addresses() const;
  // members[m] is member m's address string: its shards' addresses joined by ','.
  void configure(const std::string& job_id, int64_t quorum_id, int32_t rank,
                 const std::vector<std::string>& members, double connect_timeout_s,
                 double op_timeout_s = 0.0);
  std::pair<bool, std::string> wait_configured(double timeout_s);
  void set_op_timeout(double seconds);  // every shard's ring: see RingEndpoint::set_op_timeout
  void abort(const std::string& reason);
  std::vector<RingStats> stats();
  std::vector<RingProgress> progress() const;  // lock-free: never waits for the control thread
  // Protocol violations every shard saw since the last call (shard index, violation).
  std::vector<std::pair<int, PeerViolation>> take_violations();
  RingEndpoint* shard(int i) { return shards_[i].get(); }

 private:
  std::shared_ptr<ControlThread> thread_;  // outlives this communicator's endpoints
  std::vector<std::shared_ptr<RingEndpoint>> shards_;
};

int32_t ftar_create(int num_shards, const RingOptions& options);
std::shared_ptr<Communicator> ftar_get(int32_t handle);  // nullptr if unknown
bool ftar_destroy(int32_t handle);

struct FtarBuffer {
  const void* in = nullptr;
  void* out = nullptr;
  DType dtype = DType::kF32;
  int64_t count = 0;
};

struct FtarResult {
  bool fatal = false;  // true: reason says what is wrong (raise)
  OpStatus status = OpStatus::kOk;
  std::string reason;
};

// Sums each buffer over the ring (out = sum over ranks of in), one after the
// other, in the order given. Blocks; bounded by the communicator's timeout.
FtarResult ftar_allreduce(int32_t handle, int32_t shard, int64_t quorum_id, int32_t rank,
                          int32_t n, const std::vector<FtarBuffer>& buffers);

// The ring endpoint of (handle, shard) for a ring of n with this rank, or
// nullptr with `error` set (fatal: unknown handle, bad shard or rank). `keep`
// holds the communicator alive while the endpoint is used.
RingEndpoint* ftar_endpoint(int32_t handle, int32_t shard, int32_t rank, int32_t n,
                            std::shared_ptr<Communicator>* keep, FtarResult* error);

// One in-place all-reduce of `data` on `ep` with an explicit deadline (the
// staged GPU path runs a bucket as several of these, cut at partition
// boundaries, under one deadline, with `offload` summing on the device).
FtarResult ftar_allreduce_on(RingEndpoint* ep, int64_t quorum_id, int32_t rank, int32_t n,
                             void* data, DType dtype, int64_t count, Clock::time_point deadline,
                             ReduceOffload* offload = nullptr);

// Elements of one ring partition (chunk_elems * chunks * n) of `ep` for dtype:
// cutting a buffer at multiples of it keeps every element's summation order.
int64_t ftar_partition_elems(const RingEndpoint& ep, DType dtype, int32_t n);

}  // namespace fthsdp
