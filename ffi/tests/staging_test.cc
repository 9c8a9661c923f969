// C++ test of FTAR's GPU staging protocol on the CPU: the host side
// (ffi/staging.cc, ffi/staging_reduce.cc, through the same C table the CUDA
// handler library uses) with threads per rank standing in for the GPU. The
// fake stream does exactly what the CUDA handler enqueues: it writes the
// quorum args and raises args_ready, forks a fake reduce worker (a thread
// doing what the reduce_worker kernel does: take jobs in order, sum
// input + received slot into the staging buffer, raise consumed, end at
// reduce_stop), copies the input block by block into the staging buffer
// raising ready[b], then waits for done[b] (as the spin kernel does: no
// deadline of its own, it relies on the host releasing it), copies the block
// out, reads the status and joins the worker. Real communicators, real
// loopback sockets, real control thread.
//
// Checks: sums bitwise equal to the CPU FTAR (ftar_allreduce) for f32, bf16
// and f16 over rings of 2..4 and sizes that are not multiples of the chunk,
// with every reduce-scatter addition made by the fake worker (none on the
// control thread); a slow worker (the control thread waits for free receive
// slots); the reduce worker released at the end of every op, failed or not;
// the slot bookkeeping alone; a ring of
// one; a stream waiting on a dead/absent peer is released by abort() promptly
// and by the deadline otherwise; a stalled stream (a block never staged) is
// released at the deadline; an unknown communicator is FATAL on the device and
// raised by the next submit, once; a stale quorum id is RECOVERABLE; the pure
// block plan and ring-op cuts. Exit status 0 on success.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ftar.h"
#include "staging.h"

namespace {

using fthsdp::Clock;
using fthsdp::DType;

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  }
}

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

void* test_alloc(size_t bytes, void*) { return std::calloc(1, bytes); }
void test_release(void* p, void*) { std::free(p); }
const FthsdpAllocator kAlloc = {test_alloc, test_release, nullptr, nullptr};

uint64_t next_key() {  // each fake stream gets its own queue
  static uint64_t key = 1000;
  return ++key;
}

struct Ring {
  std::vector<int32_t> handles;
  explicit Ring(int n, double timeout_s, int64_t chunk_bytes = 1 << 12, int chunks = 3, int streams = 2) {
    fthsdp::RingOptions o;
    o.timeout_s = timeout_s;
    o.chunk_bytes = chunk_bytes;
    o.chunks = chunks;
    o.streams = streams;
    for (int r = 0; r < n; ++r) handles.push_back(fthsdp::ftar_create(1, o));
  }
  ~Ring() {
    for (int32_t h : handles) fthsdp::ftar_destroy(h);
  }
  bool configure(int64_t quorum_id) {
    std::vector<std::string> members;
    for (int32_t h : handles) members.push_back(fthsdp::ftar_get(h)->addresses()[0]);
    for (size_t r = 0; r < handles.size(); ++r) {
      fthsdp::ftar_get(handles[r])->configure("staging-test", quorum_id, static_cast<int32_t>(r), members, 10.0);
    }
    bool ok = true;
    for (int32_t h : handles) ok = ok && fthsdp::ftar_get(h)->wait_configured(12.0).first;
    return ok;
  }
};

// What the CUDA handler does on the host (plan, reserve, submit) plus what its
// stream does (the fake GPU), for one rank and one bucket.
struct FakeStream {
  const FthsdpHostApi* api = fthsdp_host_api();
  void* q = nullptr;
  uint64_t key = next_key();
  int32_t status = -1;
  std::string submit_error;
  double seconds = 0;
  bool stall_after_first_block = false;
  int worker_delay_us = 0;       // a slow "GPU": sleeps before each job
  int64_t worker_jobs = 0;       // reduce jobs the fake worker ran in the last op
  bool worker_released = false;  // it ended on reduce_stop (not the test's watchdog)
  bool worker_stalls = false;    // a wedged "GPU": never takes a job

  // What reduce_worker does, on a thread: jobs 0, 1, ... until reduce_stop reaches seq.
  void worker(FthsdpStagingControl* c, uint32_t seq) {
    worker_jobs = 0;
    worker_released = false;
    const auto guard = Clock::now() + std::chrono::seconds(60);  // the test's watchdog only
    for (uint32_t j = 0;; ++j) {
      FthsdpReduceJob& slot = c->jobs[j % FTHSDP_REDUCE_SLOTS];
      const uint64_t key = (static_cast<uint64_t>(seq) << 32) | (j + 1);
      for (;;) {
        if (!worker_stalls && __atomic_load_n(&slot.key, __ATOMIC_ACQUIRE) == key) break;
        if (static_cast<int32_t>(__atomic_load_n(&c->reduce_stop, __ATOMIC_ACQUIRE) - seq) >= 0) {
          worker_released = true;
          return;
        }
        if (Clock::now() > guard) {
          check(false, "reduce worker never released");
          return;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
      if (worker_delay_us) std::this_thread::sleep_for(std::chrono::microseconds(worker_delay_us));
      fthsdp::reduce_sum(static_cast<DType>(slot.dtype), reinterpret_cast<const void*>(slot.a),
                         reinterpret_cast<const void*>(slot.b), reinterpret_cast<void*>(slot.out),
                         static_cast<size_t>(slot.count));
      ++worker_jobs;
      for (int b = 0; b < FTHSDP_REDUCE_BLOCKS; ++b) {
        __atomic_store_n(&c->consumed[j % FTHSDP_REDUCE_SLOTS][b], key, __ATOMIC_RELEASE);
      }
    }
  }

  FakeStream() {
    char err[256] = {0};
    q = api->queue(key, &kAlloc, err, sizeof(err));
    check(q != nullptr, std::string("queue: ") + err);
  }

  // "device" buffers in and out (one per bucket); args as the five int32 scalars.
  void run_buckets(const std::vector<std::vector<char>>& in, std::vector<std::vector<char>>* out,
                   const std::vector<DType>& dtypes, int32_t comm, int32_t quorum_id, int32_t rank,
                   int32_t n) {
    const int32_t nb = static_cast<int32_t>(in.size());
    FthsdpStagedOp op{};
    op.seq = api->next_seq(q);
    op.num_buckets = nb;
    std::vector<int64_t> counts(nb);
    std::vector<int32_t> dts(nb);
    std::vector<size_t> offs(nb);
    size_t total = 0;
    for (int32_t i = 0; i < nb; ++i) {
      counts[i] = static_cast<int64_t>(in[i].size() / fthsdp::dtype_size(dtypes[i]));
      dts[i] = static_cast<int32_t>(dtypes[i]);
      offs[i] = total;
      total += (in[i].size() + 255) & ~size_t{255};
    }
    char err[256] = {0};
    char* host = static_cast<char*>(api->reserve(q, total, err, sizeof(err)));
    check(host != nullptr, std::string("reserve: ") + err);
    for (int32_t i = 0; i < nb; ++i) {
      op.bucket_host[i] = host + offs[i];
      op.bucket_device_in[i] = reinterpret_cast<uint64_t>(in[i].data());  // the "device" input
    }
    // Small blocks so that the test exercises many flags.
    op.num_blocks = api->plan(nb, counts.data(), dts.data(), 4096, op.blocks);
    if (api->submit(q, &op, err, sizeof(err)) != 0) submit_error = err;
    // --- the stream ---
    FthsdpStagingControl* c = api->control(q);
    const auto t0 = Clock::now();
    const int32_t args[kFthsdpNumArgs] = {comm, 0, quorum_id, rank, n};
    for (int i = 0; i < kFthsdpNumArgs; ++i) c->args[i] = args[i];
    __atomic_store_n(&c->args_ready, op.seq, __ATOMIC_RELEASE);
    std::thread worker_thread;  // the fork; a refused op forks none (as the handler)
    if (submit_error.empty()) worker_thread = std::thread([this, c, seq = op.seq] { worker(c, seq); });
    for (int32_t b = 0; b < op.num_blocks; ++b) {
      if (stall_after_first_block && b == 1) break;  // a wedged stream: never stages the rest
      const auto& blk = op.blocks[b];
      const size_t es = fthsdp::dtype_size(static_cast<DType>(blk.dtype));
      std::memcpy(static_cast<char*>(op.bucket_host[blk.bucket]) + blk.offset * es,
                  in[blk.bucket].data() + blk.offset * es, blk.count * es);
      __atomic_store_n(&c->ready[b], op.seq, __ATOMIC_RELEASE);
    }
    out->assign(nb, {});
    for (int32_t i = 0; i < nb; ++i) (*out)[i].assign(in[i].size(), 0);
    for (int32_t b = 0; b < op.num_blocks; ++b) {
      const auto& blk = op.blocks[b];
      const size_t es = fthsdp::dtype_size(static_cast<DType>(blk.dtype));
      const auto guard = Clock::now() + std::chrono::seconds(60);  // the test's watchdog only
      while (static_cast<int32_t>(__atomic_load_n(&c->done[b], __ATOMIC_ACQUIRE) - op.seq) < 0) {
        if (Clock::now() > guard) {
          check(false, "stream never released (block " + std::to_string(b) + ")");
          if (worker_thread.joinable()) worker_thread.join();
          return;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
      std::memcpy((*out)[blk.bucket].data() + blk.offset * es,
                  static_cast<char*>(op.bucket_host[blk.bucket]) + blk.offset * es, blk.count * es);
    }
    status = op.num_blocks ? __atomic_load_n(&c->status[op.seq & 1], __ATOMIC_ACQUIRE) : 0;
    if (worker_thread.joinable()) worker_thread.join();  // the join event
    seconds = since(t0);
  }

  void run(const std::vector<char>& in, std::vector<char>* out, DType dtype, int32_t comm,
           int32_t quorum_id, int32_t rank, int32_t n) {
    std::vector<std::vector<char>> outs;
    run_buckets({in}, &outs, {dtype}, comm, quorum_id, rank, n);
    *out = outs.empty() ? std::vector<char>() : outs[0];
  }
};

std::vector<char> random_input(DType dtype, int64_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.f, 10.f);
  std::vector<char> out(count * fthsdp::dtype_size(dtype));
  for (int64_t i = 0; i < count; ++i) {
    const float f = d(rng);
    if (dtype == DType::kF32) {
      std::memcpy(out.data() + i * 4, &f, 4);
    } else if (dtype == DType::kF16) {
      const _Float16 h = static_cast<_Float16>(f);
      std::memcpy(out.data() + i * 2, &h, 2);
    } else {
      uint32_t b;
      std::memcpy(&b, &f, 4);
      const uint16_t h = static_cast<uint16_t>(b >> 16);
      std::memcpy(out.data() + i * 2, &h, 2);
    }
  }
  return out;
}

void test_bitwise_equal_to_cpu_ftar(int n, DType dtype, int64_t count, int worker_delay_us = 0,
                                    int chunks = 3) {
  const std::string tag = "n=" + std::to_string(n) + " dtype=" + fthsdp::dtype_name(dtype) +
                          " count=" + std::to_string(count) + " delay=" + std::to_string(worker_delay_us);
  Ring ring(n, 20.0, 1 << 12, chunks);
  check(ring.configure(1), tag + ": configure");
  std::vector<std::vector<char>> in(n), staged(n), cpu(n);
  for (int r = 0; r < n; ++r) in[r] = random_input(dtype, count, 17 * r + 1);
  std::vector<FakeStream> streams(n);
  for (auto& st : streams) st.worker_delay_us = worker_delay_us;
  {
    std::vector<std::thread> ts;
    for (int r = 0; r < n; ++r) {
      ts.emplace_back([&, r] { streams[r].run(in[r], &staged[r], dtype, ring.handles[r], 1, r, n); });
    }
    for (auto& t : ts) t.join();
  }
  {
    std::vector<std::thread> ts;
    for (int r = 0; r < n; ++r) {
      cpu[r] = in[r];
      ts.emplace_back([&, r] {
        fthsdp::FtarBuffer b;
        b.in = cpu[r].data();
        b.out = cpu[r].data();
        b.dtype = dtype;
        b.count = count;
        const auto res = fthsdp::ftar_allreduce(ring.handles[r], 0, 1, r, n, {b});
        check(!res.fatal && res.status == fthsdp::OpStatus::kOk, tag + ": cpu ftar " + res.reason);
      });
    }
    for (auto& t : ts) t.join();
  }
  for (int r = 0; r < n; ++r) {
    check(streams[r].status == FTHSDP_STATUS_OK, tag + ": staged status " + std::to_string(streams[r].status));
    check(staged[r] == cpu[r], tag + ": rank " + std::to_string(r) + " staged result differs from CPU FTAR");
    check(staged[r] == staged[0], tag + ": ranks differ");
    check(streams[r].worker_released, tag + ": reduce worker ended by reduce_stop");
  }
  // Every addition of the reduce-scatter ran on the (fake) device: the
  // control thread summed nothing itself (it has no other way to get the
  // CPU FTAR's bytes than the jobs the worker ran).
  int64_t jobs = 0;
  for (const auto& st : streams) jobs += st.worker_jobs;
  check(n == 1 || jobs > 0, tag + ": the device summed nothing");
}

// A "GPU" that never takes a job: the ring cannot progress; the deadline
// fails the op RECOVERABLE and ends the worker and the stream of both ranks.
void test_wedged_device_is_released_at_the_deadline() {
  Ring ring(2, 1.0);
  check(ring.configure(1), "wedged device: configure");
  std::vector<FakeStream> s(2);
  s[0].worker_stalls = true;
  std::vector<char> in = random_input(DType::kF32, 100000, 12);
  std::vector<char> out0, out1;
  std::thread a([&] { s[0].run(in, &out0, DType::kF32, ring.handles[0], 1, 0, 2); });
  std::thread b([&] { s[1].run(in, &out1, DType::kF32, ring.handles[1], 1, 1, 2); });
  a.join();
  b.join();
  check(s[0].status == FTHSDP_STATUS_RECOVERABLE && s[1].status == FTHSDP_STATUS_RECOVERABLE,
        "wedged device: both RECOVERABLE");
  check(s[0].worker_released && s[1].worker_released, "wedged device: both workers ended by reduce_stop");
  check(s[0].seconds < 6.0 && s[1].seconds < 6.0, "wedged device: released near the deadline");
  // The queue is usable again at once: the next op on the same streams succeeds.
  s[0].worker_stalls = false;
  std::thread c([&] { s[0].run(in, &out0, DType::kF32, ring.handles[0], 1, 0, 2); });
  std::thread d([&] { s[1].run(in, &out1, DType::kF32, ring.handles[1], 1, 1, 2); });
  c.join();
  d.join();
  check(s[0].status == FTHSDP_STATUS_RECOVERABLE || s[0].status == FTHSDP_STATUS_OK,
        "wedged device: next op completes");
}

void test_pure_reduce_slots() {
  fthsdp::ReduceSlots r;
  r.reset(3);
  check(r.slots() == 3 && r.oldest() == -1, "slots: empty after reset");
  const int32_t a = r.acquire(), b = r.acquire(), c = r.acquire();
  check(a >= 0 && b >= 0 && c >= 0 && a != b && b != c && a != c, "slots: three distinct");
  check(r.acquire() == -1, "slots: a fourth is refused while all are taken");
  check(r.post(b, 7) == 0 && r.post(a, 5) == 1, "slots: jobs numbered in post order, any slot order");
  check(r.post(b, 7) == -1, "slots: a slot posted twice is refused");
  check(r.post(9, 1) == -1, "slots: a slot out of range is refused");
  check(r.oldest() == 0 && r.slot_of(0) == b && r.slot_of(1) == a, "slots: job -> slot");
  check(r.finish_oldest() == 7 && r.oldest() == 1, "slots: finished in post order, lane back");
  check(r.acquire() == b, "slots: a finished job's slot is free again");
  check(r.finish_oldest() == 5 && r.oldest() == -1 && r.in_flight() == 0, "slots: drained");
  check(r.post(c, 2) == 2, "slots: job numbers go on within an op");
  r.reset(FTHSDP_REDUCE_SLOTS + 5);
  check(r.slots() == FTHSDP_REDUCE_SLOTS && r.posted() == 0, "slots: reset clamps and restarts numbering");
  check(fthsdp::reduce_slots_for(4) == 8 && fthsdp::reduce_slots_for(1) == 2 &&
            fthsdp::reduce_slots_for(64) == FTHSDP_REDUCE_SLOTS,
        "slots: two per chunk in flight, within the ring");
  check(fthsdp::reduce_job_key(3, 0) == ((uint64_t{3} << 32) | 1) &&
            fthsdp::reduce_job_key(0xffffffffu, 41) == ((uint64_t{0xffffffffu} << 32) | 42),
        "slots: keys carry seq and job + 1 (never 0)");
}

// One op of two buckets (f32 and bf16, as a step's gradients): the blocks of
// both are released in order and each bucket matches a CPU FTAR of it.
void test_two_buckets_in_one_op() {
  const int n = 3;
  Ring ring(n, 20.0);
  check(ring.configure(1), "buckets: configure");
  std::vector<std::vector<std::vector<char>>> in(n), staged(n);
  std::vector<FakeStream> streams(n);
  for (int r = 0; r < n; ++r) in[r] = {random_input(DType::kF32, 70001, 100 + r), random_input(DType::kBF16, 50003, 200 + r)};
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r) {
    ts.emplace_back([&, r] {
      streams[r].run_buckets(in[r], &staged[r], {DType::kF32, DType::kBF16}, ring.handles[r], 1, r, n);
    });
  }
  for (auto& t : ts) t.join();
  ts.clear();
  std::vector<std::vector<std::vector<char>>> cpu = in;
  for (int r = 0; r < n; ++r) {
    ts.emplace_back([&, r] {
      std::vector<fthsdp::FtarBuffer> bufs(2);
      const DType dts[2] = {DType::kF32, DType::kBF16};
      for (int i = 0; i < 2; ++i) {
        bufs[i].in = bufs[i].out = cpu[r][i].data();
        bufs[i].dtype = dts[i];
        bufs[i].count = static_cast<int64_t>(cpu[r][i].size() / fthsdp::dtype_size(dts[i]));
      }
      const auto res = fthsdp::ftar_allreduce(ring.handles[r], 0, 1, r, n, bufs);
      check(!res.fatal && res.status == fthsdp::OpStatus::kOk, "buckets: cpu ftar " + res.reason);
    });
  }
  for (auto& t : ts) t.join();
  for (int r = 0; r < n; ++r) {
    check(streams[r].status == FTHSDP_STATUS_OK, "buckets: status OK");
    check(staged[r] == cpu[r], "buckets: rank " + std::to_string(r) + " differs from CPU FTAR");
  }
}

void test_ring_of_one() {
  FakeStream s;
  std::vector<char> in = random_input(DType::kF32, 1000, 3), out;
  s.run(in, &out, DType::kF32, /*comm=*/-1, 0, 0, 1);
  check(s.status == FTHSDP_STATUS_OK && out == in, "ring of one: output is the input, OK");
}

void test_abort_releases_a_waiting_stream() {
  Ring ring(2, 30.0);
  check(ring.configure(1), "abort: configure");
  FakeStream s;
  std::vector<char> in = random_input(DType::kF32, 200000, 5), out;
  std::thread t([&] { s.run(in, &out, DType::kF32, ring.handles[0], 1, 0, 2); });  // rank 1 never joins
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const auto t0 = Clock::now();
  fthsdp::ftar_get(ring.handles[0])->abort("lighthouse declared the peer dead");
  t.join();
  check(s.status == FTHSDP_STATUS_RECOVERABLE, "abort: status RECOVERABLE, got " + std::to_string(s.status));
  check(s.worker_released, "abort: the reduce worker is ended too");
  check(since(t0) < 2.0, "abort: stream released promptly (" + std::to_string(since(t0)) + " s)");
}

void test_deadline_releases_a_waiting_stream() {
  Ring ring(2, 1.0);
  check(ring.configure(1), "deadline: configure");
  FakeStream s;
  std::vector<char> in = random_input(DType::kF32, 100000, 6), out;
  s.run(in, &out, DType::kF32, ring.handles[0], 1, 0, 2);  // the peer never all-reduces
  check(s.status == FTHSDP_STATUS_RECOVERABLE, "deadline: status RECOVERABLE");
  check(s.seconds >= 0.9 && s.seconds < 6.0, "deadline: released at the deadline (" + std::to_string(s.seconds) + " s)");
}

void test_dead_peer_releases_the_stream() {
  Ring ring(2, 30.0);
  check(ring.configure(1), "dead peer: configure");
  FakeStream s;
  std::vector<char> in = random_input(DType::kF32, 400000, 7), out;
  std::thread t([&] { s.run(in, &out, DType::kF32, ring.handles[0], 1, 0, 2); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const auto t0 = Clock::now();
  fthsdp::ftar_destroy(ring.handles[1]);  // the peer's sockets close, as when its process dies
  ring.handles.pop_back();
  t.join();
  check(s.status == FTHSDP_STATUS_RECOVERABLE, "dead peer: status RECOVERABLE, got " + std::to_string(s.status));
  check(s.worker_released, "dead peer: the reduce worker is ended too");
  check(since(t0) < 5.0, "dead peer: released well before the 30 s deadline (" + std::to_string(since(t0)) + " s)");
}

void test_stalled_stream_is_released_at_the_deadline() {
  Ring ring(2, 1.0);
  check(ring.configure(1), "stall: configure");
  std::vector<FakeStream> s(2);
  s[0].stall_after_first_block = true;
  std::vector<char> in = random_input(DType::kF32, 100000, 8);
  std::vector<char> out0, out1;
  std::thread a([&] { s[0].run(in, &out0, DType::kF32, ring.handles[0], 1, 0, 2); });
  std::thread b([&] { s[1].run(in, &out1, DType::kF32, ring.handles[1], 1, 1, 2); });
  a.join();
  b.join();
  check(s[0].status == FTHSDP_STATUS_RECOVERABLE, "stall: the stalled rank is RECOVERABLE");
  check(s[1].status == FTHSDP_STATUS_RECOVERABLE, "stall: its peer is RECOVERABLE");
  check(s[0].seconds < 6.0 && s[1].seconds < 6.0, "stall: both released near the deadline");
}

void test_unknown_communicator_is_fatal_once() {
  FakeStream s;
  std::vector<char> in = random_input(DType::kF32, 100, 9), out;
  s.run(in, &out, DType::kF32, /*comm=*/987654, 1, 0, 2);
  check(s.status == FTHSDP_STATUS_FATAL, "unknown comm: status FATAL on the device");
  check(s.submit_error.empty(), "unknown comm: the first submit cannot know yet");
  s.run(in, &out, DType::kF32, 987654, 1, 0, 1);
  check(s.submit_error.find("unknown communicator handle 987654") != std::string::npos,
        "unknown comm: raised by the next submit, got '" + s.submit_error + "'");
  check(s.status == FTHSDP_STATUS_FATAL, "unknown comm: the refused op is released FATAL");
  s.submit_error.clear();
  s.run(in, &out, DType::kF32, -1, 0, 0, 1);
  check(s.submit_error.empty() && s.status == FTHSDP_STATUS_OK, "unknown comm: reported once, then OK");
}

void test_stale_quorum_is_recoverable() {
  Ring ring(2, 5.0);
  check(ring.configure(3), "stale: configure");
  FakeStream s;
  std::vector<char> in = random_input(DType::kF32, 100, 10), out;
  s.run(in, &out, DType::kF32, ring.handles[0], /*quorum_id=*/2, 0, 2);
  check(s.status == FTHSDP_STATUS_RECOVERABLE, "stale quorum: RECOVERABLE");
}

void test_pure_plans() {
  FthsdpStagedBlock blocks[FTHSDP_MAX_BLOCKS];
  const int64_t counts[3] = {1000003, 0, 77};
  const int32_t dts[3] = {0, 1, 1};
  const int32_t n = fthsdp::plan_blocks(3, counts, dts, 4096, blocks);
  check(n >= 2 && n <= FTHSDP_MAX_BLOCKS, "plan: block count in range");
  int64_t covered[3] = {0, 0, 0};
  for (int32_t i = 0; i < n; ++i) {
    check(blocks[i].offset == covered[blocks[i].bucket], "plan: blocks are contiguous and ordered");
    covered[blocks[i].bucket] += blocks[i].count;
    check(i == 0 || blocks[i].bucket >= blocks[i - 1].bucket, "plan: bucket order");
  }
  check(covered[0] == counts[0] && covered[1] == 0 && covered[2] == counts[2], "plan: covers every bucket once");
  std::vector<int64_t> many(FTHSDP_MAX_BLOCKS + 1, 10);
  std::vector<int32_t> mdt(many.size(), 0);
  check(fthsdp::plan_blocks(static_cast<int32_t>(many.size()), many.data(), mdt.data(), 4096, blocks) == -1,
        "plan: more buckets than blocks is refused");
  const auto cuts = fthsdp::cut_ring_ops(1000, 96, 250);
  int64_t off = 0;
  for (size_t i = 0; i < cuts.size(); ++i) {
    check(cuts[i].offset == off, "cuts: contiguous");
    if (i + 1 < cuts.size()) check(cuts[i].count % 96 == 0, "cuts: partition multiples");
    off += cuts[i].count;
  }
  check(off == 1000 && cuts.size() == 4, "cuts: cover the buffer in ops of ~target");
}

}  // namespace

int main() {
  test_pure_plans();
  test_pure_reduce_slots();
  test_ring_of_one();
  for (int n : {2, 3, 4}) {
    for (int64_t count : {int64_t{1}, int64_t{4097}, int64_t{100003}}) {
      test_bitwise_equal_to_cpu_ftar(n, DType::kF32, count);
      test_bitwise_equal_to_cpu_ftar(n, DType::kBF16, count);
    }
  }
  test_bitwise_equal_to_cpu_ftar(3, DType::kF16, 100003);
  // A slow device with one chunk in flight (two receive slots) on a ring of
  // four: chunks arrive faster than the worker frees slots, so the control
  // thread stops reading and reads on once drain() frees one (seen happening
  // a few times per run when this was written; the sums must still match).
  test_bitwise_equal_to_cpu_ftar(4, DType::kF32, 60001, /*worker_delay_us=*/300, /*chunks=*/1);
  test_wedged_device_is_released_at_the_deadline();
  test_two_buckets_in_one_op();
  test_stale_quorum_is_recoverable();
  test_unknown_communicator_is_fatal_once();
  test_abort_releases_a_waiting_stream();
  test_deadline_releases_a_waiting_stream();
  test_dead_peer_releases_the_stream();
  test_stalled_stream_is_released_at_the_deadline();
  if (failures) {
    std::fprintf(stderr, "%d failure(s)\n", failures);
    return 1;
  }
  std::printf("staging: all cases passed\n");
  return 0;
}
