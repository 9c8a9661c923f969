// The host side of FTAR's reduce on the GPU stream: receive slots, the job
// ring the reduce worker kernel reads, and the flags that release it (flag
// layout and protocol: ffi/staging_abi.h; the control thread's side:
// ffi/staging_offload.h).
//
// Pure C++ (no CUDA): ReduceSlots is plain bookkeeping, unit-tested alone;
// DeviceReducer adds the pinned memory and a watcher thread, and is tested
// on the CPU by ffi/tests/staging_test.cc with a thread playing the worker
// kernel.
//
// Slots: min(FTHSDP_REDUCE_SLOTS, 2 x chunks in flight). Each lane has at
// most one reduce that gates its next send; a second slot per lane lets the
// lane's next chunk land while the device sums the previous one, so the
// network, the copies and the reduce of different chunks overlap while
// pinning at most 2 x C x S bytes (8 MiB with the default 4 chunks of 1 MiB).
// More would not help: a lane cannot send on before its oldest sum is back.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "reduce.h"
#include "staging_abi.h"
#include "staging_offload.h"

namespace fthsdp {

// One block of a queue's host memory (pinned and device-mapped on the GPU),
// released by its allocator when the block goes. Move-only.
class HostBlock {
 public:
  HostBlock() = default;
  // Zero-filled (the allocator's contract). Throws std::runtime_error ("could not allocate N bytes of `what`").
  HostBlock(const FthsdpAllocator& alloc, size_t bytes, const char* what);
  ~HostBlock();
  HostBlock(HostBlock&& o) noexcept;
  HostBlock& operator=(HostBlock&& o) noexcept;
  HostBlock(const HostBlock&) = delete;
  HostBlock& operator=(const HostBlock&) = delete;
  char* get() const { return p_; }
  size_t size() const { return n_; }

 private:
  void reset();
  FthsdpAllocator alloc_{};
  char* p_ = nullptr;
  size_t n_ = 0;
};

// The key of job `job` of op `seq` (what jobs[].key and consumed[][] carry).
uint64_t reduce_job_key(uint32_t seq, int64_t job);

// Receive slots handed out 'any free one first', and the jobs posted on them
// finishing in post order (the worker kernel runs them in that order).
class ReduceSlots {
 public:
  // Every slot free, no jobs: the start of an op. slots in [1, FTHSDP_REDUCE_SLOTS].
  void reset(int32_t slots);
  int32_t slots() const { return static_cast<int32_t>(state_.size()); }
  // A free slot (now acquired), or -1 when all are acquired or posted.
  int32_t acquire();
  // Posts a job on an acquired slot; returns its job index (0, 1, ...), or -1
  // when `slot` was not acquired (a bug in the caller; nothing changes).
  int64_t post(int32_t slot, int32_t lane);
  // The oldest job not finished yet, or -1.
  int64_t oldest() const { return jobs_.empty() ? -1 : next_job_ - static_cast<int64_t>(jobs_.size()); }
  // Finishes the oldest job (precondition: oldest() >= 0): frees its slot; returns its lane.
  int32_t finish_oldest();
  int64_t posted() const { return next_job_; }
  int64_t in_flight() const { return static_cast<int64_t>(jobs_.size()); }
  // The slot of job `job`, which must be in flight.
  int32_t slot_of(int64_t job) const;

 private:
  enum class Slot : uint8_t { kFree, kAcquired, kPosted };
  struct Job {
    int32_t slot;
    int32_t lane;
  };
  std::vector<Slot> state_;
  std::deque<Job> jobs_;
  int64_t next_job_ = 0;
};

// Receive slots per op for C chunks in flight.
int32_t reduce_slots_for(int32_t chunks);

class DeviceReducer final : public ReduceOffload {
 public:
  // `control` is the queue's pinned control block; slots come from `alloc`.
  DeviceReducer(FthsdpStagingControl* control, const FthsdpAllocator& alloc);
  ~DeviceReducer() override;  // joins the watcher, frees the slots
  DeviceReducer(const DeviceReducer&) = delete;
  DeviceReducer& operator=(const DeviceReducer&) = delete;

  // Op `seq` begins: `slots` receive slots of at least `slot_bytes`, no jobs.
  // Throws std::runtime_error when the slots cannot be allocated.
  void begin(uint32_t seq, int32_t slots, size_t slot_bytes);
  // The next ring op works on host bytes at `host`, whose input on the
  // device is at `device_in`, of `dtype`: offsets of post() are relative to them.
  void target(char* host, uint64_t device_in, DType dtype);
  // Ends op seq's worker (raises reduce_stop). On success every job is
  // consumed already; on failure the worker leaves the rest undone.
  void stop(uint32_t seq);

  void set_waker(std::function<void()> wake) override;
  char* acquire(size_t bytes) override;
  void post(char* slot, int32_t lane, int64_t offset, int64_t count) override;
  bool drain(std::vector<int32_t>* lanes, std::string* reason) override;

  int64_t jobs_posted();  // of the current op (tests and stats)

 private:
  bool consumed(int64_t job);  // all worker blocks have summed job `job` of seq_
  void watch();

  FthsdpStagingControl* c_;
  FthsdpAllocator alloc_;
  HostBlock arena_;  // the receive slots
  size_t slot_bytes_ = 0;

  std::mutex mu_;
  std::condition_variable cv_;
  ReduceSlots slots_;
  uint32_t seq_ = 0;
  uint64_t generation_ = 0;  // bumped by begin(): the watcher restarts
  char* host_ = nullptr;
  uint64_t device_in_ = 0;
  DType dtype_ = DType::kF32;
  std::function<void()> wake_;
  int64_t watched_ = 0;  // the next job the watcher waits for
  bool stop_ = false;
  std::thread watcher_;
};

}  // namespace fthsdp
