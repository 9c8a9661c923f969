// FTAR's ring schedule as pure arithmetic: no sockets, no threads, no memory.
//
// A message of `count` elements is cut into partitions of at most
// chunk_elems * chunks * n elements (chunk size S, C chunks in flight, ring of
// n). Each partition is cut into n segments (balanced: sizes differ by at most
// one element) and each segment into C chunks (balanced too, so no chunk is
// larger than S). Chunk c of every segment travels in "lane" c: the lanes are
// independent pipelines, so C chunks are in flight at once.
//
// Per partition there are 2n-2 steps. Steps 0..n-2 are the reduce-scatter:
// rank r sends segment (r - t) and receives segment (r - t - 1), which it adds
// to its own copy. At the last of these steps (t = n-2) rank r completes
// segment (r + 1): the reduce writes the final value, which is both this
// rank's output and what it sends at the first all-gather step (the paper's
// combined store). Steps n-1..2n-3 are the all-gather: at u = t-(n-1) rank r
// forwards segment (r + 1 - u) and receives segment (r - u) as final bytes.
// Every segment's final value is computed by exactly one rank and then copied
// verbatim, so all ranks end with the same bytes (invariant 1 in the README: identical replicas).
//
// The data dependency that makes the pipeline correct: the segment a rank
// sends at step t > 0 is exactly the segment it received at step t-1, in the
// same lane, so a chunk can leave as soon as its predecessor has arrived.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace fthsdp {

enum class RecvOp : int32_t {
  kReduce = 0,       // out[range] = out[range] + received   (reduce-scatter)
  kReduceFinal = 1,  // same, and the result is final: combined store (last RS step)
  kStore = 2,        // out[range] = received                 (all-gather)
};

// A contiguous range of elements of the message.
struct Range {
  int64_t offset = 0;
  int64_t count = 0;
};

// What one rank does in one lane at one (partition, step).
struct ChunkStep {
  int64_t partition = 0;
  int32_t step = 0;
  int32_t lane = 0;
  int32_t send_segment = 0;
  int32_t recv_segment = 0;
  Range send;  // elements to send to the right neighbour (count may be 0: nothing to send)
  Range recv;  // elements received from the left neighbour (count may be 0)
  RecvOp op = RecvOp::kReduce;
};

class RingSchedule {
 public:
  // count: elements in the message; chunk_elems: max elements per chunk (>= 1);
  // chunks: lanes (C >= 1); n: ring size (>= 1); rank in [0, n).
  // Throws std::invalid_argument with a message on bad arguments.
  RingSchedule(int64_t count, int64_t chunk_elems, int32_t chunks, int32_t n, int32_t rank);

  int64_t count() const { return count_; }
  int32_t n() const { return n_; }
  int32_t rank() const { return rank_; }
  int32_t lanes() const { return chunks_; }
  int64_t partition_capacity() const { return chunk_elems_ * chunks_ * n_; }
  int64_t num_partitions() const { return num_partitions_; }
  int32_t steps_per_partition() const { return n_ > 1 ? 2 * n_ - 2 : 0; }
  // Steps a lane walks through, all partitions together.
  int64_t steps_per_lane() const { return num_partitions_ * steps_per_partition(); }

  // Element range of a partition, of segment `seg` of a partition, and of
  // chunk (lane) `lane` of that segment.
  Range partition(int64_t p) const;
  Range segment(int64_t p, int32_t seg) const;
  Range chunk(int64_t p, int32_t seg, int32_t lane) const;

  // The i-th step of a lane (i in [0, steps_per_lane())), i = p * (2n-2) + t.
  ChunkStep lane_step(int32_t lane, int64_t i) const;

  // The segment this rank holds final after the reduce-scatter ((rank+1) mod n).
  int32_t owned_segment() const { return n_ > 1 ? (rank_ + 1) % n_ : 0; }

 private:
  int32_t mod(int64_t v) const { return static_cast<int32_t>(((v % n_) + n_) % n_); }

  int64_t count_;
  int64_t chunk_elems_;
  int32_t chunks_;
  int32_t n_;
  int32_t rank_;
  int64_t num_partitions_;
};

// Balanced split of `total` into `parts` pieces: piece i's range.
Range balanced_piece(int64_t total, int64_t parts, int64_t i);

}  // namespace fthsdp
