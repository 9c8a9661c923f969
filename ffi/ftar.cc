#include "ftar.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>

#include "staging.h"

namespace fthsdp {
namespace {

// The registry of communicators: the library's one piece of global state. It
// also owns the process's control thread, started with the first communicator.
class Registry {
 public:
  ~Registry() {
    // Every ring aborted first: a staging worker in an op whose peers are gone returns now, not
    // at the op's deadline (a minute or more, which process exit waited for in its join).
    for (auto& entry : comms_) entry.second->abort("process exiting");
    // Staging queues next: their workers may be running ops on the communicators.
    queues_.clear();
    // Communicators unregister from the thread; the thread stops with its last owner.
    comms_.clear();
    thread_.reset();
  }

  int32_t create(int num_shards, const RingOptions& options) {
    std::lock_guard<std::mutex> lk(mu_);
    if (!thread_) thread_ = std::make_shared<ControlThread>();
    auto comm = std::make_shared<Communicator>(num_shards, options, thread_);
    const int32_t handle = next_++;
    comms_[handle] = std::move(comm);
    return handle;
  }

  std::shared_ptr<Communicator> get(int32_t handle) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = comms_.find(handle);
    return it == comms_.end() ? nullptr : it->second;
  }

  bool destroy(int32_t handle) {
    std::shared_ptr<Communicator> comm;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = comms_.find(handle);
      if (it == comms_.end()) return false;
      comm = std::move(it->second);
      comms_.erase(it);
    }
    comm->abort("communicator destroyed");
    return true;
  }

  StagingQueue* queue(uint64_t key, const FthsdpAllocator& alloc) {
    std::lock_guard<std::mutex> lk(mu_);
    auto& q = queues_[key];
    if (!q) q = std::make_unique<StagingQueue>(alloc);
    return q.get();
  }

 private:
  std::mutex mu_;
  std::map<uint64_t, std::unique_ptr<StagingQueue>> queues_;  // one per GPU stream
  std::shared_ptr<ControlThread> thread_;
  std::map<int32_t, std::shared_ptr<Communicator>> comms_;
  int32_t next_ = 1;
};

Registry& registry() {
  static Registry r;
  return r;
}

// Every part, empty ones included ("a,," is three parts): a member this endpoint does not
// connect to is given as empty addresses (see RingConfig::members).
std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t from = 0;
  for (size_t at = s.find(sep); at != std::string::npos; at = s.find(sep, from)) {
    out.push_back(s.substr(from, at - from));
    from = at + 1;
  }
  out.push_back(s.substr(from));
  return out;
}

}  // namespace

Communicator::Communicator(int num_shards, const RingOptions& options,
                           std::shared_ptr<ControlThread> thread)
    : thread_(std::move(thread)) {
  if (num_shards < 1 || num_shards > 1024) {
    throw std::invalid_argument("ftar: num_shards must be in [1, 1024], got " +
                                std::to_string(num_shards));
  }
  for (int i = 0; i < num_shards; ++i) {
    shards_.push_back(std::make_shared<RingEndpoint>(options, thread_.get()));
  }
  for (auto& s : shards_) thread_->add(s);
}

Communicator::~Communicator() {
  for (auto& s : shards_) thread_->remove(s.get());
}

std::vector<std::string> Communicator::addresses() const {
  std::vector<std::string> out;
  for (const auto& s : shards_) out.push_back(s->address());
  return out;
}

void Communicator::configure(const std::string& job_id, int64_t quorum_id, int32_t rank,
                             const std::vector<std::string>& members, double connect_timeout_s,
                             double op_timeout_s) {
  std::vector<std::vector<std::string>> per_member;
  for (size_t m = 0; m < members.size(); ++m) {
    auto parts = split(members[m], ',');
    if (static_cast<int>(parts.size()) != num_shards()) {
      throw std::invalid_argument(
          "ftar configure: member " + std::to_string(m) + " ('" + members[m] + "') lists " +
          std::to_string(parts.size()) + " shard addresses, this communicator has " +
          std::to_string(num_shards()) + " shards (every replica must use the same mesh)");
    }
    per_member.push_back(std::move(parts));
  }
  std::vector<RingConfig> configs(shards_.size());
  for (size_t i = 0; i < shards_.size(); ++i) {
    RingConfig& c = configs[i];
    c.job_id = job_id;
    c.quorum_id = quorum_id;
    c.rank = rank;
    c.connect_timeout_s = connect_timeout_s;
    c.op_timeout_s = op_timeout_s;
    for (const auto& pm : per_member) c.members.push_back(pm[i]);
  }
  for (size_t i = 0; i < shards_.size(); ++i) shards_[i]->configure(configs[i]);
}

void Communicator::set_op_timeout(double seconds) {
  for (auto& s : shards_) s->set_op_timeout(seconds);
}

std::pair<bool, std::string> Communicator::wait_configured(double timeout_s) {
  if (!(timeout_s >= 0) || !std::isfinite(timeout_s) || timeout_s > 7 * 24 * 3600.0) {
    throw std::invalid_argument("ftar wait_configured: timeout_s must be a finite number of seconds in [0, a week]");
  }
  const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(timeout_s));
  for (size_t i = 0; i < shards_.size(); ++i) {
    const double left = std::chrono::duration<double>(until - Clock::now()).count();
    auto r = shards_[i]->wait_configured(std::max(0.0, left));
    if (!r.first) return {false, "shard " + std::to_string(i) + ": " + r.second};
  }
  return {true, ""};
}

void Communicator::abort(const std::string& reason) {
  for (auto& s : shards_) s->abort(reason);
}

std::vector<RingStats> Communicator::stats() {
  std::vector<RingStats> out;
  for (auto& s : shards_) out.push_back(s->stats());
  return out;
}

std::vector<RingProgress> Communicator::progress() const {
  std::vector<RingProgress> out;
  for (const auto& s : shards_) out.push_back(s->progress());
  return out;
}

std::vector<std::pair<int, PeerViolation>> Communicator::take_violations() {
  std::vector<std::pair<int, PeerViolation>> out;
  for (size_t i = 0; i < shards_.size(); ++i) {
    for (auto& v : shards_[i]->take_violations()) out.emplace_back(static_cast<int>(i), std::move(v));
  }
  return out;
}

int32_t ftar_create(int num_shards, const RingOptions& options) {
  return registry().create(num_shards, options);
}

std::shared_ptr<Communicator> ftar_get(int32_t handle) { return registry().get(handle); }

bool ftar_destroy(int32_t handle) { return registry().destroy(handle); }

StagingQueue* ftar_staging_queue(uint64_t key, const FthsdpAllocator& alloc) {
  return registry().queue(key, alloc);
}

FtarResult ftar_allreduce(int32_t handle, int32_t shard, int64_t quorum_id, int32_t rank,
                          int32_t n, const std::vector<FtarBuffer>& buffers) {
  FtarResult result;
  for (const auto& b : buffers) {
    if (b.in != b.out && b.count > 0) {
      std::memcpy(b.out, b.in, static_cast<size_t>(b.count) * dtype_size(b.dtype));
    }
  }
  if (n < 1 || rank < 0 || rank >= n) {
    result.fatal = true;
    result.reason = "ftar: rank " + std::to_string(rank) + " outside ring of " + std::to_string(n);
    return result;
  }
  if (n == 1) return result;  // a ring of one: the sum is the input
  std::shared_ptr<Communicator> comm;
  RingEndpoint* ep = ftar_endpoint(handle, shard, rank, n, &comm, &result);
  if (!ep) return result;
  const auto timeout = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(ep->op_timeout_s()));
  const auto deadline = Clock::now() + timeout;  // one deadline for the whole call
  for (const auto& b : buffers) {
    result = ftar_allreduce_on(ep, quorum_id, rank, n, b.out, b.dtype, b.count, deadline);
    if (result.fatal || result.status != OpStatus::kOk) return result;
  }
  return result;
}

RingEndpoint* ftar_endpoint(int32_t handle, int32_t shard, int32_t rank, int32_t n,
                            std::shared_ptr<Communicator>* keep, FtarResult* result) {
  if (n < 1 || rank < 0 || rank >= n) {
    result->fatal = true;
    result->reason = "ftar: rank " + std::to_string(rank) + " outside ring of " + std::to_string(n);
    return nullptr;
  }
  auto comm = ftar_get(handle);
  if (!comm) {
    result->fatal = true;
    result->reason = "ftar: unknown communicator handle " + std::to_string(handle) +
                     " (create one with fthsdp.ftar.Communicator and pass its handle as quorum.comm)";
    return nullptr;
  }
  if (shard < 0 || shard >= comm->num_shards()) {
    result->fatal = true;
    result->reason = "ftar: shard index " + std::to_string(shard) + " but communicator " +
                     std::to_string(handle) + " has " + std::to_string(comm->num_shards()) +
                     " shards (create it with num_shards = number of local devices)";
    return nullptr;
  }
  RingEndpoint* ep = comm->shard(shard);
  *keep = std::move(comm);
  return ep;
}

FtarResult ftar_allreduce_on(RingEndpoint* ep, int64_t quorum_id, int32_t rank, int32_t n,
                             void* data, DType dtype, int64_t count, Clock::time_point deadline,
                             ReduceOffload* offload) {
  FtarResult result;
  auto op = std::make_shared<Op>();
  op->data = data;
  op->dtype = dtype;
  op->count = count;
  op->quorum_id = quorum_id;
  op->rank = rank;
  op->n = n;
  op->deadline = deadline;
  op->started = Clock::now();
  op->offload = offload;
  ep->run(op);
  if (op->fatal) {
    result.fatal = true;
    result.reason = op->reason;
  } else if (op->status != OpStatus::kOk) {
    result.status = op->status;
    result.reason = op->reason;
  }
  return result;
}

int64_t ftar_partition_elems(const RingEndpoint& ep, DType dtype, int32_t n) {
  const int64_t elem = static_cast<int64_t>(dtype_size(dtype));
  const int64_t chunk_elems = std::max<int64_t>(1, ep.options().chunk_bytes / elem);
  return chunk_elems * ep.options().chunks * std::max<int32_t>(1, n);
}

}  // namespace fthsdp
