// How the control thread hands the reduce-scatter's additions to a device
// (FTAR on the GPU): the interface between the control thread and the
// staging side (ffi/staging_reduce.h implements it for the CUDA data plane;
// the CPU path passes none and reduces on the control thread itself).
//
// The control thread receives a reduce-scatter chunk into a receive slot it
// acquires here, then posts it: the device computes
// data[offset .. offset+count) = input[same] + slot, where data is the op's
// (host-pinned) buffer, so the control thread can send the sum on at the
// next step. Posted reduces complete in post order; drain() reports their
// lanes, and only then does the lane move on (its next send depends on the
// sum). While every slot is taken the control thread stops reading that
// stream: slots are freed by the device alone, so that wait always ends.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace fthsdp {

class ReduceOffload {
 public:
  virtual ~ReduceOffload() = default;
  // Called by the control thread as the op begins: `wake` makes it call
  // drain() soon (posted reduces finish on the device, not on a socket).
  virtual void set_waker(std::function<void()> wake) = 0;
  // A receive slot of at least `bytes`, or nullptr while all are in use.
  virtual char* acquire(size_t bytes) = 0;
  // The chunk in `slot` (from acquire) has arrived; reduce it into the
  // op's elements [offset, offset + count). `lane` comes back from drain().
  virtual void post(char* slot, int32_t lane, int64_t offset, int64_t count) = 0;
  // Appends the lanes of the reduces finished since the last call, in post
  // order. false (reason set) when the device gave up.
  virtual bool drain(std::vector<int32_t>* lanes, std::string* reason) = 0;
};

}  // namespace fthsdp
