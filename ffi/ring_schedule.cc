#include "ring_schedule.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>

namespace fthsdp {

Range balanced_piece(int64_t total, int64_t parts, int64_t i) {
  const int64_t base = total / parts;
  const int64_t rem = total % parts;
  Range r;
  r.offset = i * base + (i < rem ? i : rem);
  r.count = base + (i < rem ? 1 : 0);
  return r;
}

RingSchedule::RingSchedule(int64_t count, int64_t chunk_elems, int32_t chunks, int32_t n,
                           int32_t rank)
    : count_(count), chunk_elems_(chunk_elems), chunks_(chunks), n_(n), rank_(rank) {
  if (count < 0) throw std::invalid_argument("ring schedule: negative element count");
  if (chunk_elems < 1) {
    throw std::invalid_argument("ring schedule: chunk size must hold at least one element, got " +
                                std::to_string(chunk_elems));
  }
  if (chunks < 1) {
    throw std::invalid_argument("ring schedule: chunks in flight must be >= 1, got " +
                                std::to_string(chunks));
  }
  if (n < 1) throw std::invalid_argument("ring schedule: ring size must be >= 1, got " + std::to_string(n));
  if (rank < 0 || rank >= n) {
    throw std::invalid_argument("ring schedule: rank " + std::to_string(rank) +
                                " outside ring of " + std::to_string(n));
  }
  // The step and element arithmetic must fit its types (found by ffi/fuzz/fuzz_ring_schedule.cc):
  // 2n-2 steps per partition in int32, chunk_elems * chunks * n elements per partition and
  // partitions * (2n-2) steps per lane in int64.
  if (n > INT32_MAX / 2) {
    throw std::invalid_argument("ring schedule: ring size " + std::to_string(n) + " exceeds " +
                                std::to_string(INT32_MAX / 2));
  }
  if (chunk_elems > INT64_MAX / chunks / n) {
    throw std::invalid_argument("ring schedule: chunk size " + std::to_string(chunk_elems) + " x chunks " +
                                std::to_string(chunks) + " x ring size " + std::to_string(n) +
                                " overflows a 64-bit element count");
  }
  const int64_t cap = partition_capacity();
  num_partitions_ = count / cap + (count % cap != 0);
  if (n > 1 && num_partitions_ > INT64_MAX / (2 * int64_t{n} - 2)) {
    throw std::invalid_argument("ring schedule: " + std::to_string(count) +
                                " elements make more steps than a 64-bit counter holds; use larger chunks");
  }
}

Range RingSchedule::partition(int64_t p) const {
  const int64_t cap = partition_capacity();
  Range r;
  r.offset = p * cap;
  r.count = r.offset < count_ ? std::min(count_ - r.offset, cap) : 0;
  return r;
}

Range RingSchedule::segment(int64_t p, int32_t seg) const {
  const Range part = partition(p);
  Range r = balanced_piece(part.count, n_, seg);
  r.offset += part.offset;
  return r;
}

Range RingSchedule::chunk(int64_t p, int32_t seg, int32_t lane) const {
  const Range s = segment(p, seg);
  Range r = balanced_piece(s.count, chunks_, lane);
  r.offset += s.offset;
  return r;
}

ChunkStep RingSchedule::lane_step(int32_t lane, int64_t i) const {
  const int32_t spp = steps_per_partition();
  ChunkStep cs;
  cs.lane = lane;
  cs.partition = i / spp;
  cs.step = static_cast<int32_t>(i % spp);
  const int32_t t = cs.step;
  if (t < n_ - 1) {  // reduce-scatter
    cs.send_segment = mod(rank_ - t);
    cs.recv_segment = mod(rank_ - t - 1);
    cs.op = (t == n_ - 2) ? RecvOp::kReduceFinal : RecvOp::kReduce;
  } else {  // all-gather
    const int32_t u = t - (n_ - 1);
    cs.send_segment = mod(rank_ + 1 - u);
    cs.recv_segment = mod(rank_ - u);
    cs.op = RecvOp::kStore;
  }
  cs.send = chunk(cs.partition, cs.send_segment, lane);
  cs.recv = chunk(cs.partition, cs.recv_segment, lane);
  return cs;
}

}  // namespace fthsdp
