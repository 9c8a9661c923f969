// C++ unit test of the ring schedule, no sockets: N in-memory ranks exchange
// the chunks the schedule names, lane by lane and step by step, reducing with
// the real kernel (fthsdp::reduce_sum). Checks for N = 1..16, odd sizes, tiny
// and empty messages, f32 and bf16: every rank ends with the same bytes, and
// integer-valued inputs sum exactly. Exit status 0 on success.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "reduce.h"
#include "ring_schedule.h"

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  }
}

uint16_t to_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

// Runs the ring over `bufs` (one per rank, `count` elements of `dtype`).
void simulate(fthsdp::DType dtype, std::vector<std::vector<char>>& bufs, int64_t count,
              int64_t chunk_elems, int32_t chunks) {
  const int32_t n = static_cast<int32_t>(bufs.size());
  const size_t es = fthsdp::dtype_size(dtype);
  std::vector<fthsdp::RingSchedule> s;
  for (int32_t r = 0; r < n; ++r) s.emplace_back(count, chunk_elems, chunks, n, r);
  std::vector<std::vector<char>> msgs(n);
  for (int32_t lane = 0; lane < chunks; ++lane) {
    for (int64_t i = 0; i < s[0].steps_per_lane(); ++i) {
      for (int32_t r = 0; r < n; ++r) {
        const auto st = s[r].lane_step(lane, i);
        const auto nx = s[(r + 1) % n].lane_step(lane, i);
        check(st.send.offset == nx.recv.offset && st.send.count == nx.recv.count,
              "sender and receiver disagree on a chunk");
        check(st.send.count <= chunk_elems, "chunk larger than S");
        msgs[r].assign(bufs[r].data() + st.send.offset * es,
                       bufs[r].data() + (st.send.offset + st.send.count) * es);
      }
      for (int32_t r = 0; r < n; ++r) {
        const auto st = s[r].lane_step(lane, i);
        const auto& m = msgs[(r + n - 1) % n];
        char* dst = bufs[r].data() + st.recv.offset * es;
        if (st.op == fthsdp::RecvOp::kStore) {
          std::memcpy(dst, m.data(), m.size());
        } else {
          fthsdp::reduce_sum(dtype, dst, m.data(), dst, static_cast<size_t>(st.recv.count));
        }
      }
    }
  }
}

void run_case(int32_t n, int64_t count, int64_t chunk_elems, int32_t chunks, bool bf16) {
  const auto dtype = bf16 ? fthsdp::DType::kBF16 : fthsdp::DType::kF32;
  const size_t es = fthsdp::dtype_size(dtype);
  std::vector<std::vector<char>> bufs(n, std::vector<char>(count * es));
  std::vector<double> expected(count, 0.0);
  for (int32_t r = 0; r < n; ++r) {
    for (int64_t i = 0; i < count; ++i) {
      // Small integers: every partial sum is exact (bf16 holds integers up to 256 exactly).
      const float v = bf16 ? static_cast<float>((i + r) % 2) : static_cast<float>((i % 7) * (r + 1));
      expected[i] += v;
      if (bf16) {
        const uint16_t h = to_bf16(v);
        std::memcpy(bufs[r].data() + i * es, &h, 2);
      } else {
        std::memcpy(bufs[r].data() + i * es, &v, 4);
      }
    }
  }
  simulate(dtype, bufs, count, chunk_elems, chunks);
  const std::string tag = "n=" + std::to_string(n) + " count=" + std::to_string(count) +
                          " S=" + std::to_string(chunk_elems) + " C=" + std::to_string(chunks) +
                          (bf16 ? " bf16" : " f32");
  for (int32_t r = 1; r < n; ++r) check(bufs[r] == bufs[0], "rank " + std::to_string(r) + " differs: " + tag);
  for (int64_t i = 0; i < count; ++i) {
    float got;
    if (bf16) {
      uint16_t h;
      std::memcpy(&h, bufs[0].data() + i * es, 2);
      const uint32_t b = static_cast<uint32_t>(h) << 16;
      std::memcpy(&got, &b, 4);
    } else {
      std::memcpy(&got, bufs[0].data() + i * es, 4);
    }
    if (static_cast<double>(got) != expected[i]) {
      check(false, "wrong sum at " + std::to_string(i) + ": " + tag);
      break;
    }
  }
}

}  // namespace

int main() {
  for (int32_t n = 1; n <= 16; ++n) {
    for (int64_t count : {int64_t{0}, int64_t{1}, int64_t{n - 1}, int64_t{n + 1}, int64_t{7 * n + 3},
                          int64_t{4099}, int64_t{100003}}) {
      run_case(n, count, 64, 3, false);
      run_case(n, count, 1, 1, false);
    }
    run_case(n, 5000, 128, 4, true);
  }
  bool threw = false;
  try {
    fthsdp::RingSchedule bad(10, 4, 2, 3, 3);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  check(threw, "rank outside the ring must throw");
  if (failures) {
    std::fprintf(stderr, "%d failure(s)\n", failures);
    return 1;
  }
  std::printf("ring schedule: all cases passed\n");
  return 0;
}
