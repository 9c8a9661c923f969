#include "staging.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "ftar.h"

namespace fthsdp {
namespace {

uint32_t load_acquire(const volatile uint32_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
int32_t load_acquire(const volatile int32_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void store_release(volatile uint32_t* p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
void store_release(volatile int32_t* p, int32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

// Wrap-safe "flag has reached seq".
bool reached(uint32_t flag, uint32_t seq) { return static_cast<int32_t>(flag - seq) >= 0; }

Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

void copy_err(const std::string& s, char* err, size_t len) {
  if (!err || len == 0) return;
  const size_t n = std::min(len - 1, s.size());
  std::memcpy(err, s.data(), n);
  err[n] = '\0';
}

}  // namespace

std::vector<Range> cut_ring_ops(int64_t count, int64_t partition_elems, int64_t target_elems) {
  std::vector<Range> out;
  if (count <= 0) return out;
  const int64_t part = std::max<int64_t>(1, partition_elems);
  const int64_t parts_per_op = std::max<int64_t>(1, (target_elems + part - 1) / part);
  const int64_t step = part * parts_per_op;
  for (int64_t off = 0; off < count; off += step) {
    out.push_back(Range{off, std::min(step, count - off)});
  }
  return out;
}

int32_t plan_blocks(int32_t num_buckets, const int64_t* counts, const int32_t* dtypes,
                    int64_t min_block_bytes, FthsdpStagedBlock* out) {
  int32_t nonempty = 0;
  int64_t total_bytes = 0;
  for (int32_t i = 0; i < num_buckets; ++i) {
    if (counts[i] < 0) return -1;
    if (counts[i] > 0) ++nonempty;
    total_bytes += counts[i] * static_cast<int64_t>(dtype_size(static_cast<DType>(dtypes[i])));
  }
  if (nonempty > FTHSDP_MAX_BLOCKS) return -1;
  // Blocks left after one per bucket are spread by size; a bucket gets at
  // most as many as keep its blocks >= min_block_bytes.
  const int64_t spare = FTHSDP_MAX_BLOCKS - nonempty;
  int32_t n = 0;
  for (int32_t i = 0; i < num_buckets; ++i) {
    if (counts[i] == 0) continue;
    const int64_t elem = static_cast<int64_t>(dtype_size(static_cast<DType>(dtypes[i])));
    const int64_t bytes = counts[i] * elem;
    const int64_t share = total_bytes > 0 ? spare * bytes / total_bytes : 0;
    const int64_t by_size = std::max<int64_t>(1, bytes / std::max<int64_t>(1, min_block_bytes));
    const int64_t pieces = std::max<int64_t>(1, std::min<int64_t>(1 + share, by_size));
    for (int64_t k = 0; k < pieces; ++k) {
      const Range r = balanced_piece(counts[i], pieces, k);
      out[n++] = FthsdpStagedBlock{i, dtypes[i], r.offset, r.count};
    }
  }
  return n;
}

StagingQueue::StagingQueue(const FthsdpAllocator& alloc) : alloc_(alloc) {
  control_ = HostBlock(alloc_, sizeof(FthsdpStagingControl), "the pinned control block");
  reducer_ = std::make_unique<DeviceReducer>(control(), alloc_);
  worker_ = std::thread([this] { loop(); });
}

StagingQueue::~StagingQueue() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
  for (const auto& q : queue_) release(q.op, 0, FTHSDP_STATUS_RECOVERABLE, "staging queue shut down");
  reducer_.reset();
  if (device_state_ && alloc_.release_device) alloc_.release_device(device_state_, alloc_.user);
  buffers_.clear();
}

void* StagingQueue::reserve(size_t bytes) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!buffers_.empty() && buffers_.back().size() >= bytes) return buffers_.back().get();
  size_t cap = 1 << 20;
  while (cap < bytes) cap <<= 1;
  buffers_.emplace_back(alloc_, cap, "pinned staging buffer");  // earlier ones stay: queued ops may use them
  return buffers_.back().get();
}

uint32_t StagingQueue::next_seq() {
  std::lock_guard<std::mutex> lk(mu_);
  return next_seq_;
}

bool StagingQueue::submit(const FthsdpStagedOp& op, std::string* fatal) {
  std::unique_lock<std::mutex> lk(mu_);
  next_seq_ = op.seq + 1;
  Queued q{op, ""};
  if (!fatal_.empty()) {
    *fatal = fatal_;
    q.refused = fatal_;
    fatal_.clear();
  }
  queue_.push_back(std::move(q));
  lk.unlock();
  cv_.notify_one();
  return fatal->empty();
}

StagingQueue::Stats StagingQueue::stats() {
  std::lock_guard<std::mutex> lk(mu_);
  return stats_;
}

void StagingQueue::loop() {
  for (;;) {
    Queued q;
    {
      std::unique_lock<std::mutex> lk(mu_);
      // Bounded wait: re-checks stop_ even if a notification was missed.
      cv_.wait_for(lk, std::chrono::milliseconds(200), [&] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      if (queue_.empty()) continue;
      q = std::move(queue_.front());
      queue_.pop_front();
    }
    if (q.refused.empty()) {
      run(q.op);
    } else {
      release(q.op, 0, FTHSDP_STATUS_FATAL, q.refused);
    }
  }
}

bool StagingQueue::wait_flag(const volatile uint32_t* flag, uint32_t seq, Clock::time_point until) {
  for (uint32_t spins = 0;; ++spins) {
    if (reached(load_acquire(flag), seq)) return true;
    if (spins < 256) continue;  // the GPU usually answers within microseconds
    if (stop_.load(std::memory_order_relaxed) || Clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(spins < 4096 ? 5 : 50));
  }
}

void StagingQueue::release(const FthsdpStagedOp& op, int32_t from, int32_t status,
                           const std::string& reason) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (status == FTHSDP_STATUS_OK) {
      ++stats_.ops_ok;
    } else {
      if (status == FTHSDP_STATUS_FATAL) ++stats_.ops_fatal; else ++stats_.ops_recoverable;
      stats_.last_error = reason;
    }
  }
  reducer_->stop(op.seq);  // the worker ends; its jobs are all consumed unless this op failed
  FthsdpStagingControl* c = control();
  store_release(&c->status[op.seq & 1], status);
  for (int32_t b = std::max(0, from); b < op.num_blocks; ++b) store_release(&c->done[b], op.seq);
}

void StagingQueue::run(const FthsdpStagedOp& op) {
  FthsdpStagingControl* c = control();
  if (!wait_flag(&c->args_ready, op.seq, Clock::now() + seconds(kStagingStartWaitS))) {
    release(op, 0, FTHSDP_STATUS_RECOVERABLE,
            stop_ ? "staging queue shut down" : "the GPU stream never reached the all-reduce");
    return;
  }
  int32_t a[kFthsdpNumArgs];
  for (int i = 0; i < kFthsdpNumArgs; ++i) a[i] = load_acquire(&c->args[i]);
  const int32_t rank = a[kFthsdpArgRank], n = a[kFthsdpArgNumMembers];
  const int64_t quorum_id = a[kFthsdpArgQuorumId];
  if (n == 1 && rank == 0) {  // a ring of one: the staged input is the sum
    release(op, 0, FTHSDP_STATUS_OK, "");
    return;
  }
  FtarResult err;
  std::shared_ptr<Communicator> keep;
  RingEndpoint* ep = ftar_endpoint(a[kFthsdpArgComm], a[kFthsdpArgShard], rank, n, &keep, &err);
  if (!ep) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      fatal_ = err.reason;
    }
    release(op, 0, FTHSDP_STATUS_FATAL, err.reason);
    return;
  }
  // The network deadline counts from the moment the stream reached the op.
  const auto deadline = Clock::now() + seconds(ep->op_timeout_s());
  try {
    reducer_->begin(op.seq, reduce_slots_for(ep->options().chunks),
                    static_cast<size_t>(ep->options().chunk_bytes));
  } catch (const std::exception& e) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      fatal_ = e.what();
    }
    release(op, 0, FTHSDP_STATUS_FATAL, e.what());
    return;
  }
  int32_t waited = 0;  // blocks [0, waited) are staged
  int32_t raised = 0;  // blocks [0, raised) are released
  int64_t ring_ops = 0;
  for (int32_t first = 0; first < op.num_blocks;) {
    const int32_t bucket = op.blocks[first].bucket;
    int32_t last = first;  // blocks [first, last) belong to this bucket
    int64_t count = 0;
    while (last < op.num_blocks && op.blocks[last].bucket == bucket) {
      count = op.blocks[last].offset + op.blocks[last].count;
      ++last;
    }
    const DType dtype = static_cast<DType>(op.blocks[first].dtype);
    const size_t elem = dtype_size(dtype);
    char* host = static_cast<char*>(op.bucket_host[bucket]);
    const auto cuts = cut_ring_ops(count, ftar_partition_elems(*ep, dtype, n), op.blocks[first].count);
    for (const Range& r : cuts) {
      const int64_t end = r.offset + r.count;
      while (waited < last && op.blocks[waited].offset < end) {
        if (!wait_flag(&c->ready[waited], op.seq, deadline)) {
          release(op, raised, FTHSDP_STATUS_RECOVERABLE,
                  stop_ ? "staging queue shut down"
                        : "timeout: the GPU did not stage block " + std::to_string(waited) +
                              " before the all-reduce deadline");
          return;
        }
        ++waited;
      }
      reducer_->target(host + r.offset * elem, op.bucket_device_in[bucket] + r.offset * elem, dtype);
      const FtarResult res = ftar_allreduce_on(ep, quorum_id, rank, n, host + r.offset * elem, dtype,
                                               r.count, deadline, reducer_.get());
      ++ring_ops;
      if (res.fatal) {
        {
          std::lock_guard<std::mutex> lk(mu_);
          fatal_ = res.reason;
        }
        release(op, raised, FTHSDP_STATUS_FATAL, res.reason);
        return;
      }
      if (res.status != OpStatus::kOk) {
        release(op, raised, FTHSDP_STATUS_RECOVERABLE, res.reason);
        return;
      }
      // Blocks wholly summed are released now; the last one after the status.
      while (raised < last && op.blocks[raised].offset + op.blocks[raised].count <= end) {
        if (raised == op.num_blocks - 1) break;
        store_release(&c->done[raised], op.seq);
        ++raised;
      }
    }
    first = last;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    stats_.ring_ops += ring_ops;
    stats_.device_reduces += reducer_->jobs_posted();
  }
  release(op, raised, FTHSDP_STATUS_OK, "");
}

}  // namespace fthsdp

// ---------------------------------------------------------------------------
// The C table.

namespace {

void* api_queue(uint64_t key, const FthsdpAllocator* alloc, char* err, size_t len) {
  try {
    return fthsdp::ftar_staging_queue(key, *alloc);
  } catch (const std::exception& e) {
    fthsdp::copy_err(e.what(), err, len);
    return nullptr;
  }
}

FthsdpStagingControl* api_control(void* q) { return static_cast<fthsdp::StagingQueue*>(q)->control(); }

void** api_device_state(void* q) { return static_cast<fthsdp::StagingQueue*>(q)->device_state(); }

void* api_reserve(void* q, size_t bytes, char* err, size_t len) {
  try {
    return static_cast<fthsdp::StagingQueue*>(q)->reserve(bytes);
  } catch (const std::exception& e) {
    fthsdp::copy_err(e.what(), err, len);
    return nullptr;
  }
}

uint32_t api_next_seq(void* q) { return static_cast<fthsdp::StagingQueue*>(q)->next_seq(); }

int api_submit(void* q, const FthsdpStagedOp* op, char* err, size_t len) {
  std::string fatal;
  if (static_cast<fthsdp::StagingQueue*>(q)->submit(*op, &fatal)) return 0;
  fthsdp::copy_err(fatal, err, len);
  return 1;
}

const FthsdpHostApi kHostApi = {FTHSDP_STAGING_ABI, api_queue,  api_control,      api_reserve,
                                api_next_seq,       api_submit, api_device_state, fthsdp::plan_blocks};

}  // namespace

extern "C" const FthsdpHostApi* fthsdp_host_api(void) { return &kHostApi; }
