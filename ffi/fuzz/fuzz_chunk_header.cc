// libFuzzer harness: the chunk header that precedes every FTAR payload, as the
// receiving stream judges it against its own schedule.
//
// Input: the first sizeof(ChunkHeader) bytes are the header on the wire; the
// rest build a real RingSchedule (bounded sizes), the op sequence, the stream
// the header arrived on and each lane's next expected step (anywhere in
// [0, steps_per_lane], the end included: a finished lane). A flags byte lets
// the receiver's expectation mirror the header, so the accept path is reached.
//
// Properties: check_chunk_header never crashes; whatever it accepts is a step
// of the schedule that is still due (index == next_recv < steps_per_lane), on
// the right stream, of the right op, whose byte count is the schedule's, and
// whose receive range lies inside the message.
#include <fuzzer/FuzzedDataProvider.h>

#include <optional>
#include <stdexcept>
#include <vector>

#include "fuzz_check.h"
#include "ring_schedule.h"
#include "transport/wire.h"

using namespace fthsdp;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < sizeof(tcp::ChunkHeader)) return 0;
  tcp::ChunkHeader h;
  FUZZ_CHECK(wire::decode_chunk_header(data, sizeof(tcp::ChunkHeader), &h));
  FuzzedDataProvider fdp(data + sizeof(tcp::ChunkHeader), size - sizeof(tcp::ChunkHeader));

  const int64_t count = fdp.ConsumeIntegralInRange<int64_t>(0, 1 << 20);
  const int64_t chunk_elems = fdp.ConsumeIntegralInRange<int64_t>(1, 1 << 16);
  const int32_t chunks = fdp.ConsumeIntegralInRange<int32_t>(1, 16);
  const int32_t n = fdp.ConsumeIntegralInRange<int32_t>(2, 64);
  const int32_t rank = fdp.ConsumeIntegralInRange<int32_t>(0, n - 1);
  const RingSchedule sched(count, chunk_elems, chunks, n, rank);
  const int32_t streams = fdp.ConsumeIntegralInRange<int32_t>(1, 64);
  const uint8_t copy = fdp.ConsumeIntegral<uint8_t>();
  const size_t elem = fdp.PickValueInArray<size_t>({2, 4});

  std::vector<int64_t> next(static_cast<size_t>(sched.lanes()));
  for (auto& v : next) v = fdp.ConsumeIntegralInRange<int64_t>(0, sched.steps_per_lane());
  wire::ChunkExpect e;
  e.op_seq = (copy & 1) ? h.op_seq : fdp.ConsumeIntegral<uint64_t>();
  e.lanes = next.size();
  e.streams = streams;
  e.stream = (copy & 2) ? h.lane % static_cast<uint32_t>(streams)
                        : fdp.ConsumeIntegralInRange<size_t>(0, static_cast<size_t>(streams) - 1);
  if ((copy & 4) && h.lane < next.size() && h.index >= 0 && h.index <= sched.steps_per_lane()) {
    next[h.lane] = h.index;
  }
  e.next_recv = [&next](uint32_t lane) {
    FUZZ_CHECK(lane < next.size());  // only asked for a lane already checked to exist
    return next[lane];
  };
  e.schedule = &sched;
  e.elem = elem;

  const wire::ChunkDecision d = wire::check_chunk_header(h, e);
  if (d.ok) {
    FUZZ_CHECK(d.error.empty());
    FUZZ_CHECK(h.magic == tcp::kChunkMagic && h.op_seq == e.op_seq);
    FUZZ_CHECK(h.lane < e.lanes && h.lane % static_cast<uint32_t>(streams) == e.stream);
    FUZZ_CHECK(h.index == next[h.lane] && h.index >= 0 && h.index < sched.steps_per_lane());
    FUZZ_CHECK(h.bytes == static_cast<uint64_t>(d.step.recv.count) * elem);
    FUZZ_CHECK(d.step.recv.offset >= 0 && d.step.recv.count >= 0 &&
               d.step.recv.offset + d.step.recv.count <= count);
    FUZZ_CHECK(d.step.recv.count <= chunk_elems);
  } else {
    FUZZ_CHECK(!d.error.empty());
  }
  return 0;
}
