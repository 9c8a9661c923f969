// libFuzzer harness: the ring schedule's arguments.
//
// Input: (count, chunk_elems, chunks, n, rank) anywhere in their types' ranges.
// Properties: the constructor either throws std::invalid_argument or builds a
// schedule whose arithmetic stays in range (no signed overflow: UBSan); for a
// schedule it accepts, sampled lane steps have send/receive ranges inside the
// message, no chunk larger than chunk_elems, and the pipelining invariant: what
// a lane sends at step t > 0 of a partition is what it received at step t-1.
#include <fuzzer/FuzzedDataProvider.h>

#include <stdexcept>

#include "fuzz_check.h"
#include "ring_schedule.h"

using namespace fthsdp;

namespace {

void check_range(const Range& r, const RingSchedule& s, int64_t chunk_elems) {
  FUZZ_CHECK(r.offset >= 0 && r.count >= 0);
  FUZZ_CHECK(r.count <= chunk_elems);
  FUZZ_CHECK(r.count == 0 || r.offset + r.count <= s.count());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider fdp(data, size);
  const int64_t count = fdp.ConsumeIntegral<int64_t>();
  const int64_t chunk_elems = fdp.ConsumeIntegral<int64_t>();
  const int32_t chunks = fdp.ConsumeIntegral<int32_t>();
  const int32_t n = fdp.ConsumeIntegral<int32_t>();
  const int32_t rank = fdp.ConsumeIntegral<int32_t>();
  try {
    const RingSchedule s(count, chunk_elems, chunks, n, rank);
    FUZZ_CHECK(count >= 0 && chunk_elems >= 1 && chunks >= 1 && n >= 1 && rank >= 0 && rank < n);
    FUZZ_CHECK(s.num_partitions() >= 0 && s.steps_per_lane() >= 0);
    if (s.steps_per_lane() == 0) return 0;
    for (int k = 0; k < 8 && fdp.remaining_bytes() > 0; ++k) {
      const int32_t lane = fdp.ConsumeIntegralInRange<int32_t>(0, s.lanes() - 1);
      const int64_t i = fdp.ConsumeIntegralInRange<int64_t>(0, s.steps_per_lane() - 1);
      const ChunkStep cs = s.lane_step(lane, i);
      FUZZ_CHECK(cs.lane == lane && cs.partition == i / s.steps_per_partition());
      check_range(cs.send, s, chunk_elems);
      check_range(cs.recv, s, chunk_elems);
      if (cs.step > 0) {
        const ChunkStep prev = s.lane_step(lane, i - 1);
        FUZZ_CHECK(prev.recv_segment == cs.send_segment);
        FUZZ_CHECK(prev.recv.offset == cs.send.offset && prev.recv.count == cs.send.count);
      }
    }
  } catch (const std::invalid_argument&) {
    // refused with a message: fine
  }
  return 0;
}
