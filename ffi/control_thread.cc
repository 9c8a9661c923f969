#include "control_thread.h"

#include "transport/wire.h"

#include <errno.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace fthsdp {
namespace {

std::string io_error(int err) { return err ? std::string(strerror(err)) : "closed by peer"; }

Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

constexpr auto kRetryDelay = std::chrono::milliseconds(20);
constexpr double kMaxTimeoutS = 7 * 24 * 3600.0;  // a week (fthsdp.timeouts.Timeouts.MAX_S)
constexpr size_t kReadBudget = 8u << 20;  // bytes read from one stream per wake-up
// Hostile-input limits of one listener (see control_thread.h).
constexpr size_t kMaxPending = 64;                          // undecided handshakes
constexpr auto kHandshakeDeadline = std::chrono::seconds(5);  // hello after connect; proof after challenge
constexpr auto kHeldLimit = std::chrono::seconds(120);        // a hello waiting for this rank's configure

// Test hook, off unless set: every chunk this process sends waits this many
// seconds first (a throttled stream, for testing root-cause analysis of slow
// links). Set it in one process's environment only.
constexpr const char* kSendDelayEnv = "FTHSDP_FTAR_TEST_SEND_DELAY_S";

Clock::duration send_delay_from_env() {
  const char* v = std::getenv(kSendDelayEnv);
  if (v == nullptr || *v == '\0') return Clock::duration::zero();
  char* end = nullptr;
  const double s = std::strtod(v, &end);
  if (end == v || *end != '\0' || !(s >= 0) || s > 10) {
    throw std::invalid_argument(std::string("ftar: ") + kSendDelayEnv + "=" + v +
                                " is not a number of seconds in [0, 10]; unset it (it is a test hook)");
  }
  if (s > 0) {
    std::fprintf(stderr, "fthsdp ftar: test hook %s=%g: every chunk sent waits %g s\n", kSendDelayEnv, s, s);
  }
  return seconds(s);
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

}  // namespace

// ---------------------------------------------------------------------------
// Public side (any thread).

RingEndpoint::RingEndpoint(const RingOptions& options, ControlThread* thread)
    : options_(options),
      key_(options.key.empty() ? crypto::HmacKey() : crypto::HmacKey(options.key)),
      thread_(thread) {
  if (options.streams < 1 || options.streams > kMaxStreams) {
    throw std::invalid_argument("ftar: streams per peer must be in [1, " + std::to_string(kMaxStreams) + "], got " +
                                std::to_string(options.streams));
  }
  if (options.chunks < 1 || options.chunks > 256) {
    throw std::invalid_argument("ftar: chunks in flight must be in [1, 256], got " +
                                std::to_string(options.chunks));
  }
  if (options.chunk_bytes < 64 || options.chunk_bytes > (int64_t{1} << 30)) {
    throw std::invalid_argument("ftar: chunk_bytes must be in [64, 2^30], got " +
                                std::to_string(options.chunk_bytes));
  }
  if (!(options.timeout_s > 0) || !std::isfinite(options.timeout_s) || options.timeout_s > kMaxTimeoutS) {
    throw std::invalid_argument("ftar: timeout_s must be a finite number of seconds in (0, a week]");
  }
  send_delay_ = send_delay_from_env();
  if (!options.key.empty() && options.key.size() < 16) {
    throw std::invalid_argument("ftar: a job key must have at least 16 bytes, got " +
                                std::to_string(options.key.size()));
  }
  listen_fd_ = tcp::listen_on(options.listen_host, 0, &address_);
  // Receive staging of S x C, touched now so that no op pays first-touch faults.
  staging_.resize(static_cast<size_t>(options.chunk_bytes) * options.chunks);
  std::memset(staging_.data(), 0, staging_.size());
}

RingEndpoint::~RingEndpoint() {
  // The sender threads (joined by ~OutStream) write p_out_, declared after out_ and so
  // destroyed before it: stop them first.
  out_.clear();
  in_.clear();
}

void RingEndpoint::configure(const RingConfig& config) {
  const int64_t n = static_cast<int64_t>(config.members.size());
  if (n < 1) throw std::invalid_argument("ftar configure: members must not be empty");
  if (config.rank < 0 || config.rank >= n) {
    throw std::invalid_argument("ftar configure: rank " + std::to_string(config.rank) +
                                " outside ring of " + std::to_string(n) + " members");
  }
  if (config.job_id.empty() || config.job_id.size() >= tcp::kJobIdMax) {
    throw std::invalid_argument("ftar configure: job_id must have 1.." +
                                std::to_string(tcp::kJobIdMax - 1) + " characters");
  }
  if (!(config.connect_timeout_s > 0) || !std::isfinite(config.connect_timeout_s) ||
      config.connect_timeout_s > kMaxTimeoutS) {  // (past it, the deadline's nanoseconds overflow)
    throw std::invalid_argument("ftar configure: connect_timeout_s must be a finite number of seconds in (0, a week]");
  }
  check_op_timeout(config.op_timeout_s);
  RingConfig resolved = config;
  for (int64_t i = 0; i < n; ++i) {
    const std::string& m = config.members[static_cast<size_t>(i)];
    const bool neighbour = n > 1 && (i == (config.rank + 1) % n || i == (config.rank + n - 1) % n);
    if (m.empty() && !neighbour) continue;  // a member this endpoint does not connect to
    // Every address must be well formed (a malformed one is the caller's bug), but only the right
    // neighbour's is resolved: it is the one connected to. A name that does not resolve (a dead
    // member's DNS record gone before the quorum dropped it) fails the ring, RECOVERABLE, with the
    // reason: thrown, it ended this healthy replica over a peer it never connects to.
    std::string host, error;
    long port = 0;
    if (!wire::split_host_port(m, &host, &port, &error)) {
      throw std::invalid_argument("ftar configure: member " + std::to_string(i) + ": " + error);
    }
    if (n > 1 && i == (config.rank + 1) % n) {
      tcp::Address addr;
      if (tcp::parse_address(m, &addr, &error)) {
        resolved.right_address = addr;
      } else {
        resolved.resolve_error = "right neighbour " + m + ": " + error;
      }
    }
  }
  op_timeout_s_.store(config.op_timeout_s, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lk(mu_);
    commands_.push_back(Command{true, std::move(resolved), ""});
    ++config_gen_;
    state_ = State::kConnecting;
    state_reason_.clear();
  }
  thread_->wake();
}

void RingEndpoint::check_op_timeout(double seconds) {
  if (!(seconds >= 0) || !std::isfinite(seconds) || seconds > kMaxTimeoutS) {
    throw std::invalid_argument("ftar configure: op_timeout_s must be a finite number of seconds in [0, a week] "
                                "(0: the communicator's timeout_s)");
  }
}

void RingEndpoint::set_op_timeout(double seconds) {
  check_op_timeout(seconds);
  op_timeout_s_.store(seconds, std::memory_order_relaxed);
}

std::pair<bool, std::string> RingEndpoint::wait_configured(double timeout_s) {
  if (!(timeout_s >= 0) || !std::isfinite(timeout_s) || timeout_s > kMaxTimeoutS) {
    throw std::invalid_argument("ftar wait_configured: timeout_s must be a finite number of seconds in [0, a week]");
  }
  std::unique_lock<std::mutex> lk(mu_);
  const auto until = Clock::now() + seconds(timeout_s);
  const bool decided =
      state_cv_.wait_until(lk, until, [&] { return state_ != State::kConnecting; });
  if (!decided) return {false, "still connecting after " + std::to_string(timeout_s) + " s"};
  if (state_ == State::kReady) return {true, ""};
  if (state_ == State::kUnconfigured) return {false, "not configured"};
  return {false, state_reason_};
}

void RingEndpoint::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    commands_.push_back(Command{false, RingConfig{}, reason});
  }
  thread_->wake();
}

void RingEndpoint::run(const std::shared_ptr<Op>& op) {
  std::unique_lock<std::mutex> lk(mu_);
  if (submitted_) {
    op->done = true;
    op->fatal = true;
    op->reason = "two all-reduces were submitted concurrently to one ring endpoint";
    return;
  }
  submitted_ = op;
  lk.unlock();
  thread_->wake();
  lk.lock();
  const auto pred = [&] { return op->done; };
  // The control thread enforces op->deadline itself; the margins only guard
  // against a control thread that stopped making progress (a bug).
  if (op->cv.wait_until(lk, op->deadline + std::chrono::seconds(2), pred)) return;
  if (submitted_ == op) {
    submitted_.reset();
    op->done = true;
    op->status = OpStatus::kRecoverable;
    op->reason = "the control thread did not start the all-reduce before its deadline";
    return;
  }
  commands_.push_back(Command{false, RingConfig{}, "all-reduce overran its deadline"});
  lk.unlock();
  thread_->wake();
  lk.lock();
  if (op->cv.wait_until(lk, op->deadline + std::chrono::seconds(7), pred)) return;
  op->done = true;
  op->fatal = true;
  op->reason = "ftar control thread unresponsive: all-reduce neither finished nor aborted";
}

std::vector<PeerViolation> RingEndpoint::take_violations() {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<PeerViolation> out;
  out.swap(violations_);
  return out;
}

RingStats RingEndpoint::stats() {
  std::lock_guard<std::mutex> lk(mu_);
  RingStats s = stats_;
  constexpr auto relaxed = std::memory_order_relaxed;
  s.chunk_mac_ns = p_check_mac_ns_.load(relaxed);
  s.chunk_macs = p_check_macs_.load(relaxed);
  for (const auto& c : p_out_) {
    s.chunk_mac_ns += c.mac_ns.load(relaxed);
    s.chunk_macs += c.macs.load(relaxed);
  }
  switch (state_) {
    case State::kUnconfigured: s.state = "unconfigured"; break;
    case State::kConnecting: s.state = "connecting"; break;
    case State::kReady: s.state = "ready"; break;
    case State::kFailed: s.state = "failed: " + state_reason_; break;
  }
  return s;
}

RingProgress RingEndpoint::progress() const {
  constexpr auto relaxed = std::memory_order_relaxed;
  RingProgress p;
  p.in_op = p_in_op_.load(relaxed);
  p.op_seq = p_op_seq_.load(relaxed);
  p.rank = p_rank_.load(relaxed);
  p.n = p_n_.load(relaxed);
  p.ring_steps = p.n > 1 ? 2 * p.n - 2 : 0;
  p.ring_step = p_ring_step_.load(relaxed);
  p.recv_done = p_recv_done_.load(relaxed);
  p.recv_total = p_recv_total_.load(relaxed);
  p.sends_queued = p_sends_queued_.load(relaxed);
  const int64_t now = now_ns();
  if (p.in_op) {
    p.op_s = static_cast<double>(now - p_op_start_ns_.load(relaxed)) * 1e-9;
    p.since_recv_s = static_cast<double>(now - p_last_recv_ns_.load(relaxed)) * 1e-9;
  }
  for (int i = 0; i < options_.streams; ++i) {
    p.bytes_sent.push_back(p_out_[i].bytes.load(relaxed));
    p.send_busy_s.push_back(static_cast<double>(p_out_[i].busy_ns.load(relaxed)) * 1e-9);
    p.bytes_received.push_back(p_in_bytes_[i].load(relaxed));
  }
  return p;
}

void RingEndpoint::note_recv_progress() {
  // The slowest lane says how far this rank is: which ring step it waits on.
  constexpr auto relaxed = std::memory_order_relaxed;
  int64_t least = sched_->steps_per_lane();
  int32_t slowest = 0;
  for (size_t l = 0; l < lanes_.size(); ++l) {
    if (lanes_[l].next_recv < least) {
      least = lanes_[l].next_recv;
      slowest = static_cast<int32_t>(l);
    }
  }
  p_recv_done_.store(least, relaxed);
  if (least < sched_->steps_per_lane()) p_ring_step_.store(sched_->lane_step(slowest, least).step, relaxed);
  p_last_recv_ns_.store(now_ns(), relaxed);
}

// ---------------------------------------------------------------------------
// Control-thread side.

int32_t RingEndpoint::left() const {
  const int32_t n = static_cast<int32_t>(cfg_->members.size());
  return (cfg_->rank + n - 1) % n;
}

int32_t RingEndpoint::right() const {
  const int32_t n = static_cast<int32_t>(cfg_->members.size());
  return (cfg_->rank + 1) % n;
}

void RingEndpoint::set_state(State s, const std::string& reason) {
  local_state_ = s;
  local_reason_ = reason;
  std::lock_guard<std::mutex> lk(mu_);
  if (applied_gen_ != config_gen_) return;  // a newer configure() is queued
  state_ = s;
  state_reason_ = reason;
  if (s == State::kFailed) stats_.last_error = reason;
  state_cv_.notify_all();
}

void RingEndpoint::take_commands(Clock::time_point now) {
  for (;;) {
    Command cmd;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (commands_.empty()) break;
      cmd = std::move(commands_.front());
      commands_.pop_front();
      if (cmd.is_configure) {
        ++applied_gen_;
        ++stats_.configures;
      }
    }
    if (cmd.is_configure) {
      apply_configure(cmd.config, now);
    } else {
      fail("aborted: " + cmd.reason);
    }
  }
  std::shared_ptr<Op> op;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!op_ && submitted_) op = std::move(submitted_);
  }
  if (op) {
    op_ = std::move(op);
    start_op(now);
  }
}

void RingEndpoint::close_all() {
  out_.clear();
  in_.clear();
  ++epoch_;
}

void RingEndpoint::apply_configure(const RingConfig& config, Clock::time_point now) {
  close_all();  // first: sender threads must stop touching the op's buffer before it returns
  if (op_) finish_op(OpStatus::kRecoverable, false, "quorum changed while an all-reduce was in flight");
  cfg_ = config;
  op_seq_ = 0;
  const int32_t n = static_cast<int32_t>(config.members.size());
  if (n == 1) {
    set_state(State::kReady, "");
    return;
  }
  out_.resize(options_.streams);
  for (auto& s : out_) {
    s.phase = OutStream::Phase::kWaitRetry;
    s.retry_at = now;
  }
  in_.resize(options_.streams);
  connect_deadline_ = now + seconds(config.connect_timeout_s);
  set_state(State::kConnecting, "");
  if (!config.resolve_error.empty()) {
    fail("cannot connect the ring for quorum " + std::to_string(config.quorum_id) + ": " + config.resolve_error);
    return;
  }
  // Hellos that arrived before this configure() may belong to it: re-checked
  // now (and challenged); none of them took a slot while held.
  for (auto& p : pending_) {
    if (p.fd.valid() && p.phase == Pending::Phase::kHeld) decide(&p, now);
  }
}

void RingEndpoint::check_ready() {
  if (local_state_ != State::kConnecting) return;
  for (const auto& s : out_) {
    if (s.phase != OutStream::Phase::kReady) return;
  }
  for (const auto& s : in_) {
    if (!s.fd.valid()) return;
  }
  set_state(State::kReady, "");
  if (op_ && !sched_) begin_op();
}

void RingEndpoint::fail_on_exception(std::exception_ptr error) noexcept {
  std::string what = "unknown exception";
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
  }
  try {
    fail("internal error on the FTAR control thread: " + what, /*fatal=*/true);
  } catch (...) {
    // Failing needs memory too: with none left, the op's deadline ends it (run() waits no longer).
  }
}

void RingEndpoint::fail(const std::string& reason, bool fatal) {
  close_all();
  if (cfg_) {
    set_state(State::kFailed, reason);
  } else {
    std::lock_guard<std::mutex> lk(mu_);
    stats_.last_error = reason;
  }
  if (op_) finish_op(OpStatus::kRecoverable, fatal, reason);
}

void RingEndpoint::finish_op(OpStatus status, bool fatal, const std::string& reason) {
  // The progress view leaves the op before its waiter is woken: a caller that reads
  // progress() right after its all-reduce returned must not still see it running.
  p_in_op_.store(false, std::memory_order_relaxed);
  p_sends_queued_.store(0, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lk(mu_);
    op_->done = true;
    op_->fatal = fatal;
    op_->status = status;
    op_->reason = reason;
    if (fatal) {
      ++stats_.ops_fatal;
    } else if (status == OpStatus::kOk) {
      ++stats_.ops_ok;
    } else {
      ++stats_.ops_recoverable;
    }
    if (status != OpStatus::kOk || fatal) stats_.last_error = reason;
    op_->cv.notify_all();
  }
  op_.reset();
  sched_.reset();
  lanes_.clear();
}

void RingEndpoint::start_op(Clock::time_point now) {
  (void)now;
  Op& op = *op_;
  if (!cfg_) {
    finish_op(OpStatus::kRecoverable, false, "ftar communicator is not configured yet");
    return;
  }
  const int32_t n = static_cast<int32_t>(cfg_->members.size());
  // The step carries the low 31 bits of the quorum id (an int32 array input; ids run to 2**53),
  // the host path the whole id: compare what both carry (fthsdp/step/quorum_inputs.py).
  constexpr int64_t kStepQuorumIdMask = 0x7FFFFFFF;
  if ((op.quorum_id & kStepQuorumIdMask) != (cfg_->quorum_id & kStepQuorumIdMask)) {
    finish_op(OpStatus::kRecoverable, false,
              "stale quorum id: the step carries quorum " + std::to_string(op.quorum_id) +
                  " but the communicator is configured for quorum " +
                  std::to_string(cfg_->quorum_id) + " (compared on their low 31 bits: " +
                  std::to_string(op.quorum_id & kStepQuorumIdMask) + " and " +
                  std::to_string(cfg_->quorum_id & kStepQuorumIdMask) + ")");
    return;
  }
  if (op.n != n || op.rank != cfg_->rank) {
    finish_op(OpStatus::kRecoverable, true,
              "bad quorum inputs: the step says rank " + std::to_string(op.rank) + " of " +
                  std::to_string(op.n) + " but quorum " + std::to_string(cfg_->quorum_id) +
                  " configured this communicator as rank " + std::to_string(cfg_->rank) +
                  " of " + std::to_string(n));
    return;
  }
  if (local_state_ == State::kFailed) {
    finish_op(OpStatus::kRecoverable, false, "ring is down: " + local_reason_);
    return;
  }
  if (n == 1 || op.count == 0) {
    finish_op(OpStatus::kOk, false, "");
    return;
  }
  if (local_state_ == State::kReady) begin_op();
  // else: connecting; check_ready() begins it, or the deadline fails it.
}

void RingEndpoint::begin_op() {
  Op& op = *op_;
  elem_ = dtype_size(op.dtype);
  const int64_t chunk_elems = std::max<int64_t>(1, options_.chunk_bytes / static_cast<int64_t>(elem_));
  sched_.emplace(op.count, chunk_elems, options_.chunks, op.n, op.rank);
  ++op_seq_;
  lanes_.assign(options_.chunks, Lane{});
  lanes_done_ = 0;
  {
    constexpr auto relaxed = std::memory_order_relaxed;
    const int64_t t = now_ns();
    p_op_seq_.store(static_cast<int64_t>(op_seq_), relaxed);
    p_rank_.store(op.rank, relaxed);
    p_n_.store(op.n, relaxed);
    p_ring_step_.store(0, relaxed);
    p_recv_done_.store(0, relaxed);
    p_recv_total_.store(sched_->steps_per_lane(), relaxed);
    p_sends_queued_.store(0, relaxed);
    p_op_start_ns_.store(t, relaxed);
    p_last_recv_ns_.store(t, relaxed);
    p_in_op_.store(true, relaxed);
  }
  const int k = options_.streams;
  for (auto& s : in_) {
    s.expected = 0;
    s.reading_payload = false;
    s.awaiting_slot = false;
    s.done = 0;
  }
  if (op.offload) op.offload->set_waker([t = thread_] { t->wake(); });
  const int64_t total = sched_->steps_per_lane();
  for (int32_t lane = 0; lane < options_.chunks; ++lane) {
    for (int64_t i = 0; i < total; ++i) {
      if (sched_->lane_step(lane, i).recv.count > 0) ++in_[lane % k].expected;
    }
  }
  for (int32_t lane = 0; lane < options_.chunks && op_; ++lane) advance(lane);
  op_maybe_done();
}

void RingEndpoint::advance(int32_t lane) {
  Lane& L = lanes_[lane];
  const int64_t total = sched_->steps_per_lane();
  while (L.next_arrive < total && sched_->lane_step(lane, L.next_arrive).recv.count == 0) ++L.next_arrive;
  // A step is received once it arrived and, if the device sums it, is summed.
  L.next_recv = L.reducing.empty() ? L.next_arrive : L.reducing.front();
  for (;;) {
    // Queue every send that is ready, in lane order: a lane may have a
    // forwarded chunk and the next partition's first chunk in flight at once.
    if (L.next_send < total) {
      const ChunkStep cs = sched_->lane_step(lane, L.next_send);
      if (cs.step == 0 || L.next_recv >= L.next_send) {
        if (cs.send.count > 0) {
          SendItem item;
          item.header.magic = tcp::kChunkMagic;
          item.header.lane = static_cast<uint32_t>(lane);
          item.header.op_seq = op_seq_;
          item.header.index = L.next_send;
          item.bytes = static_cast<size_t>(cs.send.count) * elem_;
          item.header.bytes = item.bytes;
          item.data = static_cast<const char*>(op_->data) + cs.send.offset * static_cast<int64_t>(elem_);
          item.lane = lane;
          out_[lane % options_.streams].sender->push(item);
          ++L.in_flight;
          p_sends_queued_.fetch_add(1, std::memory_order_relaxed);
        }
        ++L.next_send;
        continue;
      }
    }
    break;
  }
  if (!L.done && L.next_send == total && L.in_flight == 0 && L.next_recv == total) {
    L.done = true;
    ++lanes_done_;
  }
}

// Lanes whose chunks the device has summed move on (their next send is that
// sum), and streams that waited for a receive slot read on.
void RingEndpoint::drain_reduces() {
  if (!op_->offload) return;
  std::vector<int32_t> lanes;
  std::string reason;
  if (!op_->offload->drain(&lanes, &reason)) {
    fail("ftar (gpu): " + reason, /*fatal=*/true);
    return;
  }
  for (int32_t lane : lanes) {
    if (!op_ || !sched_) return;
    lanes_[lane].reducing.pop_front();
    advance(lane);
    op_maybe_done();
  }
  const uint64_t epoch = epoch_;
  for (size_t i = 0; i < in_.size() && op_ && sched_ && epoch == epoch_; ++i) {
    if (in_[i].awaiting_slot) on_in(i, 0);
  }
}

void RingEndpoint::op_maybe_done() {
  if (op_ && sched_ && lanes_done_ == static_cast<int64_t>(lanes_.size())) {
    finish_op(OpStatus::kOk, false, "");
  }
}

void RingEndpoint::busy(tcp::Fd fd, const std::string& reason) {
  const tcp::Reply reply = wire::make_busy(reason);
  (void)::send(fd.get(), &reply, sizeof(reply), MSG_NOSIGNAL | MSG_DONTWAIT);
  std::lock_guard<std::mutex> lk(mu_);
  ++stats_.refused_handshakes;
}

void RingEndpoint::refuse(tcp::Fd fd, const std::string& reason) {
  const tcp::Reply reply = wire::make_reply(false, reason);
  (void)::send(fd.get(), &reply, sizeof(reply), MSG_NOSIGNAL | MSG_DONTWAIT);
  std::lock_guard<std::mutex> lk(mu_);
  ++stats_.refused_handshakes;
  stats_.last_error = "refused a handshake: " + reason;
}

int RingEndpoint::decide(Pending* p, Clock::time_point now) {
  const tcp::Hello& h = p->hello;
  // The decision is wire::check_hello's (pure, fuzzed in ffi/fuzz/); this only gathers its inputs.
  wire::HelloExpect expect;
  expect.configured = cfg_.has_value();
  if (cfg_) {
    expect.job_id = cfg_->job_id;
    expect.quorum_id = cfg_->quorum_id;
    expect.rank = cfg_->rank;
    expect.n = static_cast<int32_t>(cfg_->members.size());
    expect.left = left();
    expect.streams = options_.streams;
    for (const auto& in : in_) expect.taken.push_back(in.fd.valid());
    expect.failed = local_state_ == State::kFailed;
    expect.failed_reason = local_reason_;
  }
  expect.auth = !key_.empty();
  const wire::HelloDecision verdict = wire::check_hello(h, expect);
  if (verdict.verdict == wire::HelloVerdict::kHold) {
    if (p->phase != Pending::Phase::kHeld) {
      p->phase = Pending::Phase::kHeld;
      p->deadline = now + kHeldLimit;
    }
    return -1;
  }
  if (verdict.verdict == wire::HelloVerdict::kRefuse) {
    refuse(std::move(p->fd), verdict.reason);
    return 0;
  }
  if (!key_.empty() && !p->proven) {
    // The fields match a configured neighbour and the slot is free: challenge
    // it. The slot stays free until its proof checks out, so a stranger who
    // guessed the fields holds nothing the real neighbour needs.
    crypto::random_bytes(p->nonce, sizeof(p->nonce));
    const tcp::Reply challenge = wire::make_challenge(key_, h, p->nonce);
    if (::send(p->fd.get(), &challenge, sizeof(challenge), MSG_NOSIGNAL | MSG_DONTWAIT) !=
        static_cast<ssize_t>(sizeof(challenge))) {
      p->fd.reset();
      return 0;
    }
    p->phase = Pending::Phase::kProof;
    p->proof_done = 0;
    p->deadline = now + kHandshakeDeadline;
    return -1;
  }
  const tcp::Reply reply = wire::make_reply(true, "");
  if (::send(p->fd.get(), &reply, sizeof(reply), MSG_NOSIGNAL | MSG_DONTWAIT) !=
      static_cast<ssize_t>(sizeof(reply))) {
    p->fd.reset();
    return 0;
  }
  tcp::tune_stream(p->fd.get(), options_.socket_buffer_bytes);
  InStream& in = in_[h.stream];
  in.fd = std::move(p->fd);
  in.conn_key = key_.empty() ? crypto::HmacKey() : wire::connection_key(key_, h, p->nonce);
  in.seq = 0;
  check_ready();
  return 1;
}

void RingEndpoint::violation(int32_t rank, const std::string& what) {
  const std::string reason = "ftar protocol violation from left neighbour " + cfg_->members[rank] +
                             " (rank " + std::to_string(rank) + " of quorum " +
                             std::to_string(cfg_->quorum_id) + "): " + what;
  {
    std::lock_guard<std::mutex> lk(mu_);
    ++stats_.violations;
    if (violations_.size() < kMaxViolations) {
      violations_.push_back(PeerViolation{cfg_->quorum_id, rank, cfg_->members[rank], reason});
    }
  }
  fail(reason);  // RECOVERABLE: the peer's fault; this rank's state is intact
}

void RingEndpoint::on_accept(Clock::time_point now) {
  for (;;) {
    tcp::Fd fd = tcp::accept_one(listen_fd_.get());
    if (!fd.valid()) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        // Out of descriptors: the connection stays queued and the listener stays readable, so a
        // level-triggered poll would spin this thread (every ring's driver) at 100% CPU. The
        // listener is left out of the poll for a moment; what is queued is accepted after.
        accept_paused_until_ = now + std::chrono::milliseconds(100);
      }
      break;
    }
    size_t live = 0;
    for (const auto& q : pending_) live += q.fd.valid();
    if (live >= kMaxPending) {
      // Full: close the oldest connection that has not even sent its hello (an
      // idle stranger; an honest neighbour sends its hello as soon as it is
      // connected), else the oldest held hello (one for a quorum this rank is
      // not configured for), else the oldest one challenged for its proof: its
      // hello's fields are public (a stranger can earn a challenge), and an honest
      // neighbour answers within a round trip, so only a flood of 64 newer
      // connections inside that round trip could close it before it proves
      // itself. Each is told "busy": an honest sender retries, so a flood can
      // delay a neighbour but not lock it out.
      Pending* victim = nullptr;
      for (auto phase : {Pending::Phase::kHello, Pending::Phase::kHeld, Pending::Phase::kProof}) {
        for (auto& q : pending_) {  // pending_ is in arrival order
          if (!q.fd.valid() || q.phase != phase) continue;
          if (phase == Pending::Phase::kHello && q.done >= sizeof(tcp::Hello)) continue;
          victim = &q;
          break;
        }
        if (victim) break;
      }
      if (!victim) {
        busy(std::move(fd), std::to_string(kMaxPending) + " FTAR handshakes pending at this rank; try again");
        continue;
      }
      busy(std::move(victim->fd), "closed to bound pending handshakes (" + std::to_string(kMaxPending) +
                                      " at this rank); try again");
    }
    Pending p;
    p.fd = std::move(fd);
    p.since = now;
    p.deadline = now + kHandshakeDeadline;
    pending_.push_back(std::move(p));
  }
}

void RingEndpoint::on_pending(size_t i, short revents, Clock::time_point now) {
  (void)revents;
  Pending& p = pending_[i];
  if (!p.fd.valid()) return;
  if (p.phase == Pending::Phase::kProof) {
    int err = 0;
    const tcp::Io io = tcp::recv_into(p.fd.get(), &p.proof, sizeof(p.proof), &p.proof_done, &err);
    if (io == tcp::Io::kClosed || io == tcp::Io::kError) {
      p.fd.reset();
      return;
    }
    if (p.proof_done < sizeof(p.proof)) return;
    if (!wire::check_proof(key_, p.hello, p.nonce, p.proof)) {
      refuse(std::move(p.fd), "bad proof: the peer does not hold this job's secret");
      return;
    }
    p.proven = true;
    decide(&p, now);  // re-checked: the slot may have been taken or the ring reconfigured meanwhile
    return;
  }
  if (p.done < sizeof(tcp::Hello)) {
    int err = 0;
    const tcp::Io io = tcp::recv_into(p.fd.get(), &p.hello, sizeof(p.hello), &p.done, &err);
    if (io == tcp::Io::kClosed || io == tcp::Io::kError) {
      p.fd.reset();
      return;
    }
    if (p.done == sizeof(tcp::Hello)) decide(&p, now);
  } else {
    // A held connection: readable now means its peer gave up (EOF) or broke protocol. Bytes
    // after its hello, before the answer, are a violation: refused now (left unread, poll is
    // level-triggered and reported them on every pass, spinning this thread until the hold's
    // deadline, for anyone who sends a hello and one byte more).
    char c;
    const ssize_t r = ::recv(p.fd.get(), &c, 1, MSG_DONTWAIT | MSG_PEEK);
    if (r > 0) {
      refuse(std::move(p.fd), "sent data after its hello before it was answered (protocol violation)");
    } else if (r == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) {
      p.fd.reset();
    }
  }
}

void RingEndpoint::on_out(size_t i, short revents, Clock::time_point now) {
  OutStream& s = out_[i];
  using Phase = OutStream::Phase;
  const std::string peer = cfg_->members[right()];
  if (s.phase == Phase::kConnecting) {
    const int err = tcp::connect_result(s.fd.get());
    if (err != 0) {
      s.fd.reset();
      s.phase = Phase::kWaitRetry;
      s.retry_at = now + kRetryDelay;
      return;
    }
    tcp::tune_stream(s.fd.get(), options_.socket_buffer_bytes);
    uint8_t nonce[tcp::kNonceBytes];
    crypto::random_bytes(nonce, sizeof(nonce));
    s.hello = wire::make_hello(cfg_->job_id, cfg_->quorum_id, cfg_->rank,
                               static_cast<int32_t>(cfg_->members.size()), static_cast<int32_t>(i),
                               options_.streams, !key_.empty(), nonce);
    s.io_done = 0;
    s.challenged = false;
    s.phase = Phase::kHello;
  }
  if (s.phase == Phase::kHello) {
    int err = 0;
    const tcp::Io io = tcp::send_two(s.fd.get(), &s.hello, sizeof(s.hello), nullptr, 0, &s.io_done, &err);
    if (io == tcp::Io::kClosed || io == tcp::Io::kError) {
      s.fd.reset();
      s.phase = Phase::kWaitRetry;
      s.retry_at = now + kRetryDelay;
      return;
    }
    if (s.io_done == sizeof(s.hello)) {
      s.io_done = 0;
      s.phase = Phase::kAwaitReply;
    }
    return;
  }
  if (s.phase == Phase::kAwaitReply) {
    int err = 0;
    const tcp::Io io = tcp::recv_into(s.fd.get(), &s.reply, sizeof(s.reply), &s.io_done, &err);
    if (io == tcp::Io::kClosed || io == tcp::Io::kError) {
      s.fd.reset();
      s.phase = Phase::kWaitRetry;
      s.retry_at = now + kRetryDelay;
      return;
    }
    if (s.io_done < sizeof(s.reply)) return;
    const wire::ReplyDecision r = wire::read_reply(s.reply);
    if (r.busy) {  // the neighbour's listener is full (a flood?): try again shortly
      s.fd.reset();
      s.phase = Phase::kWaitRetry;
      s.retry_at = now + kRetryDelay;
      return;
    }
    if (!r.accepted && !r.challenge) {
      fail("right neighbour " + peer + " refused the handshake: " + r.reason);
      return;
    }
    if (r.challenge) {
      if (key_.empty() || s.challenged) {
        fail("right neighbour " + peer + " sent an unexpected challenge" +
             (key_.empty() ? " (it holds a job secret, this rank runs without one)" : ""));
        return;
      }
      if (!wire::check_challenge(key_, s.hello, s.reply)) {
        fail("right neighbour " + peer +
             " failed to prove the job secret (not a member of this job, or a different secret)");
        return;
      }
      s.challenged = true;
      s.proof = wire::make_proof(key_, s.hello, s.reply.nonce);
      s.conn_key = wire::connection_key(key_, s.hello, s.reply.nonce);
      s.io_done = 0;
      s.phase = Phase::kProof;
      // fall through: the socket is almost surely writable
    } else {
      if (!key_.empty() && !s.challenged) {
        fail("right neighbour " + peer + " accepted without proving the job secret");
        return;
      }
      s.phase = Phase::kReady;
      s.sender = std::make_unique<Sender>(s.fd.get(), thread_, &p_out_[i], send_delay_, s.conn_key);
      check_ready();
      return;
    }
  }
  if (s.phase == Phase::kProof) {
    int err = 0;
    const tcp::Io io = tcp::send_two(s.fd.get(), &s.proof, sizeof(s.proof), nullptr, 0, &s.io_done, &err);
    if (io == tcp::Io::kClosed || io == tcp::Io::kError) {
      s.fd.reset();
      s.phase = Phase::kWaitRetry;
      s.retry_at = now + kRetryDelay;
      return;
    }
    if (s.io_done == sizeof(s.proof)) {
      s.io_done = 0;
      s.reply = tcp::Reply{};
      s.phase = Phase::kAwaitReply;
    }
    return;
  }
  (void)revents;
}

void RingEndpoint::drain_senders() {
  std::vector<int32_t> lanes;
  const uint64_t epoch = epoch_;
  for (size_t i = 0; i < out_.size(); ++i) {
    if (!out_[i].sender) continue;
    lanes.clear();
    int err = 0;
    const bool ok = out_[i].sender->take_completed(&lanes, &err);
    const int64_t bytes = out_[i].sender->take_bytes();
    if (bytes) {
      std::lock_guard<std::mutex> lk(mu_);
      stats_.bytes_sent += bytes;
    }
    if (!ok) {
      fail("connection to right neighbour " + cfg_->members[right()] + " lost: " + io_error(err));
      return;
    }
    for (int32_t lane : lanes) {
      if (!op_ || !sched_) return;
      --lanes_[lane].in_flight;
      p_sends_queued_.fetch_sub(1, std::memory_order_relaxed);
      advance(lane);
      op_maybe_done();
      if (epoch != epoch_) return;
    }
  }
}

void RingEndpoint::on_in(size_t i, short revents) {
  (void)revents;
  const std::string peer = cfg_->members[left()];
  size_t budget = kReadBudget;
  while (op_ && sched_) {
    InStream& s = in_[i];
    if (s.awaiting_slot) {  // drain_reduces() freed a slot, perhaps
      s.dest = op_->offload->acquire(static_cast<size_t>(s.header.bytes));
      if (!s.dest) return;
      s.awaiting_slot = false;
      s.reading_payload = true;
      s.done = 0;
    }
    if (!s.reading_payload) {
      if (s.expected <= 0) return;
      int err = 0;
      const tcp::Io io = tcp::recv_into(s.fd.get(), &s.header, sizeof(s.header), &s.done, &err);
      if (io == tcp::Io::kWouldBlock) return;
      if (io != tcp::Io::kProgress) {
        fail("connection from left neighbour " + peer + " lost: " + io_error(err));
        return;
      }
      if (s.done < sizeof(s.header)) continue;
      {
        std::lock_guard<std::mutex> lk(mu_);
        stats_.bytes_received += static_cast<int64_t>(sizeof(s.header));
      }
      const tcp::ChunkHeader& h = s.header;
      if (!key_.empty()) {
        const int64_t mac_from = now_ns();
        const bool tag_ok = wire::check_chunk_tag(s.conn_key, s.seq, h);
        p_check_mac_ns_.fetch_add(now_ns() - mac_from, std::memory_order_relaxed);
        p_check_macs_.fetch_add(1, std::memory_order_relaxed);
        if (!tag_ok) {
          violation(left(), "unauthenticated chunk header (its MAC does not verify under this connection's key)");
          return;
        }
        ++s.seq;
      }
      // The header is judged by wire::check_chunk_header (pure, fuzzed in ffi/fuzz/).
      wire::ChunkExpect expect;
      expect.op_seq = op_seq_;
      expect.lanes = lanes_.size();
      expect.streams = options_.streams;
      expect.stream = i;
      expect.next_recv = [this](uint32_t lane) { return lanes_[lane].next_arrive; };
      expect.schedule = &*sched_;
      expect.elem = elem_;
      const wire::ChunkDecision verdict = wire::check_chunk_header(h, expect);
      if (!verdict.ok) {
        violation(left(), verdict.error);
        return;
      }
      {
        const ChunkStep& cs = verdict.step;
        s.lane = static_cast<int32_t>(h.lane);
        if (cs.op == RecvOp::kStore) {
          s.dest = static_cast<char*>(op_->data) + cs.recv.offset * static_cast<int64_t>(elem_);
        } else if (op_->offload) {
          s.dest = op_->offload->acquire(static_cast<size_t>(h.bytes));
        } else {
          s.dest = staging_.data() + static_cast<size_t>(h.lane) * options_.chunk_bytes;
        }
      }
      s.done = 0;
      if (!s.dest) {  // every slot is with the device: read on once one is free
        s.awaiting_slot = true;
        return;
      }
      s.reading_payload = true;
    }
    int err = 0;
    const size_t before = s.done;
    const tcp::Io io = tcp::recv_into(s.fd.get(), s.dest, s.header.bytes, &s.done, &err);
    if (io == tcp::Io::kWouldBlock) return;
    if (io != tcp::Io::kProgress) {
      fail("connection from left neighbour " + peer + " lost: " + io_error(err));
      return;
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      stats_.bytes_received += static_cast<int64_t>(s.done - before);
    }
    p_in_bytes_[i].fetch_add(static_cast<int64_t>(s.done - before), std::memory_order_relaxed);
    const size_t got = s.done - before;
    if (s.done < s.header.bytes) {
      if (got >= budget) return;
      budget -= got;
      continue;
    }
    const int32_t lane = s.lane;
    const ChunkStep cs = sched_->lane_step(lane, s.header.index);
    if (cs.op != RecvOp::kStore && op_->offload) {
      op_->offload->post(s.dest, lane, cs.recv.offset, cs.recv.count);
      lanes_[lane].reducing.push_back(s.header.index);
    } else if (cs.op != RecvOp::kStore) {
      char* out = static_cast<char*>(op_->data) + cs.recv.offset * static_cast<int64_t>(elem_);
      reduce_sum(op_->dtype, out, s.dest, out, static_cast<size_t>(cs.recv.count));
    }
    s.reading_payload = false;
    s.done = 0;
    --s.expected;
    ++lanes_[lane].next_arrive;
    advance(lane);  // moves next_recv up to the oldest step the device has not summed
    note_recv_progress();
    op_maybe_done();
    if (got >= budget) return;
    budget -= got;
  }
}

void RingEndpoint::poll_prepare(Clock::time_point now, std::vector<pollfd>* fds,
                                Clock::time_point* wake_at) {
  take_commands(now);
  if (op_ && now >= op_->deadline) {
    // (how long this op ran: a reconfiguration since may have changed the ring's deadline)
    const auto waited = std::chrono::duration<double>(now - op_->started).count();
    fail("timeout: the all-reduce did not finish within " + std::to_string(waited) +
         " s (a peer is stopped, overloaded or unreachable)");
  }
  if (local_state_ == State::kConnecting && now >= connect_deadline_) {
    int out_ready = 0, in_ready = 0;
    for (const auto& s : out_) out_ready += s.phase == OutStream::Phase::kReady;
    for (const auto& s : in_) in_ready += s.fd.valid();
    fail("timeout connecting the ring for quorum " + std::to_string(cfg_->quorum_id) + ": " +
         std::to_string(out_ready) + "/" + std::to_string(out_.size()) +
         " streams to right neighbour " + cfg_->members[right()] + " and " +
         std::to_string(in_ready) + "/" + std::to_string(in_.size()) +
         " streams from left neighbour " + cfg_->members[left()] + " established");
  }
  if (local_state_ == State::kConnecting) {
    const tcp::Address& addr = cfg_->right_address;  // resolved by configure(): no DNS here
    const bool ok = addr.len > 0;
    for (auto& s : out_) {
      if (s.phase != OutStream::Phase::kWaitRetry) continue;
      if (now < s.retry_at) {
        *wake_at = std::min(*wake_at, s.retry_at);
        continue;
      }
      int err = 0;
      tcp::Fd fd = ok ? tcp::connect_start(addr, &err) : tcp::Fd();
      if (!fd.valid()) {
        s.retry_at = now + kRetryDelay;
        *wake_at = std::min(*wake_at, s.retry_at);
        continue;
      }
      s.fd = std::move(fd);
      s.phase = OutStream::Phase::kConnecting;
    }
    *wake_at = std::min(*wake_at, connect_deadline_);
  }
  if (op_) *wake_at = std::min(*wake_at, op_->deadline);
  // Handshakes past their phase's deadline are refused with the reason; decided ones dropped.
  for (auto& p : pending_) {
    if (!p.fd.valid() || now < p.deadline) continue;
    switch (p.phase) {
      case Pending::Phase::kHello:
        refuse(std::move(p.fd), "handshake deadline: no complete hello within " +
                                    std::to_string(std::chrono::duration_cast<std::chrono::seconds>(
                                                       kHandshakeDeadline).count()) + " s of connecting");
        break;
      case Pending::Phase::kProof:
        refuse(std::move(p.fd), "handshake deadline: no proof within " +
                                    std::to_string(std::chrono::duration_cast<std::chrono::seconds>(
                                                       kHandshakeDeadline).count()) + " s of the challenge");
        break;
      case Pending::Phase::kHeld:
        refuse(std::move(p.fd), "held hello expired: this rank was not configured for quorum " +
                                    std::to_string(p.hello.quorum_id) + " in time");
        break;
    }
  }
  pending_.erase(std::remove_if(pending_.begin(), pending_.end(), [](const Pending& p) { return !p.fd.valid(); }),
                 pending_.end());
  for (const auto& p : pending_) *wake_at = std::min(*wake_at, p.deadline);

  slot_base_ = fds->size();
  slots_.clear();
  auto add = [&](int fd, short events, int kind, size_t index) {
    fds->push_back(pollfd{fd, events, 0});
    slots_.push_back(Slot{kind, index});
  };
  if (now >= accept_paused_until_) {
    add(listen_fd_.get(), POLLIN, 0, 0);
  } else {
    *wake_at = std::min(*wake_at, accept_paused_until_);
  }
  for (size_t i = 0; i < pending_.size(); ++i) add(pending_[i].fd.get(), POLLIN, 1, i);
  for (size_t i = 0; i < out_.size(); ++i) {
    const OutStream& s = out_[i];
    switch (s.phase) {
      case OutStream::Phase::kConnecting:
      case OutStream::Phase::kHello:
      case OutStream::Phase::kProof: add(s.fd.get(), POLLOUT, 2, i); break;
      case OutStream::Phase::kAwaitReply: add(s.fd.get(), POLLIN, 2, i); break;
      default: break;
    }
  }
  if (op_ && sched_) {
    for (size_t i = 0; i < in_.size(); ++i) {
      const InStream& s = in_[i];
      if (s.fd.valid() && !s.awaiting_slot && (s.expected > 0 || s.reading_payload)) {
        add(s.fd.get(), POLLIN, 3, i);
      }
    }
  }
}

void RingEndpoint::poll_handle(const std::vector<pollfd>& fds, Clock::time_point now) {
  if (op_ && sched_) drain_senders();
  if (op_ && sched_) drain_reduces();
  const uint64_t epoch = epoch_;
  for (size_t j = 0; j < slots_.size(); ++j) {
    const short rev = fds[slot_base_ + j].revents;
    if (rev == 0) continue;
    if (epoch != epoch_) break;  // connections were dropped: the rest of the slots are stale
    const Slot& slot = slots_[j];
    switch (slot.kind) {
      case 0: on_accept(now); break;
      case 1: on_pending(slot.index, rev, now); break;
      case 2: on_out(slot.index, rev, now); break;
      case 3: on_in(slot.index, rev); break;
    }
  }
}

// ---------------------------------------------------------------------------

RingEndpoint::Sender::Sender(int fd, ControlThread* wake, StreamCounters* counters, Clock::duration delay,
                             const crypto::HmacKey& key)
    : fd_(fd), wake_(wake), counters_(counters), delay_(delay), key_(key) {
  thread_ = std::thread([this] { loop(); });
}

RingEndpoint::Sender::~Sender() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void RingEndpoint::Sender::push(const SendItem& item) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    queue_.push_back(item);
  }
  cv_.notify_one();
}

bool RingEndpoint::Sender::take_completed(std::vector<int32_t>* lanes, int* err) {
  std::lock_guard<std::mutex> lk(mu_);
  lanes->swap(completed_);
  completed_.clear();
  *err = err_;
  return !broken_;
}

void RingEndpoint::Sender::loop() {
  for (;;) {
    SendItem item;
    {
      std::unique_lock<std::mutex> lk(mu_);
      // Idle until a chunk is queued; the bounded wait only re-checks stop_.
      if (!cv_.wait_for(lk, std::chrono::milliseconds(100),
                        [&] { return stop_ || (!queue_.empty() && !broken_); })) {
        continue;
      }
      if (stop_) return;
      item = queue_.front();
    }
    const auto busy_from = Clock::now();
    if (delay_ > Clock::duration::zero()) {  // the throttle test hook
      std::unique_lock<std::mutex> lk(mu_);
      if (cv_.wait_for(lk, delay_, [&] { return stop_; })) return;
    }
    // Tagged here, in the order chunks leave on this connection (the receiver counts the same).
    if (!key_.empty()) {
      const auto mac_from = Clock::now();
      wire::tag_chunk(key_, seq_++, &item.header);
      counters_->mac_ns.fetch_add(
          std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - mac_from).count(),
          std::memory_order_relaxed);
      counters_->macs.fetch_add(1, std::memory_order_relaxed);
    }
    if (wake_->corrupt_this_chunk()) item.header.magic ^= 0x1;  // test hook, off by default
    size_t sent = 0;
    const size_t total = sizeof(item.header) + item.bytes;
    while (sent < total) {
      int err = 0;
      const size_t before = sent;
      const tcp::Io io = tcp::send_two(fd_, &item.header, sizeof(item.header), item.data, item.bytes,
                                       &sent, &err);
      if (io == tcp::Io::kProgress) {
        bytes_ += static_cast<int64_t>(sent - before);
        continue;
      }
      if (io == tcp::Io::kWouldBlock) {
        {
          std::lock_guard<std::mutex> lk(mu_);
          if (stop_) return;
        }
        pollfd p{fd_, POLLOUT, 0};
        ::poll(&p, 1, 20);  // short: stop_ is checked between waits
        continue;
      }
      {
        std::lock_guard<std::mutex> lk(mu_);
        broken_ = true;
        err_ = err;
      }
      wake_->wake();
      return;
    }
    // Bytes and busy time move together, per whole chunk: a rate read between
    // two reads of these counters is never skewed by a chunk half counted.
    counters_->bytes.fetch_add(static_cast<int64_t>(total), std::memory_order_relaxed);
    counters_->busy_ns.fetch_add(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - busy_from).count(),
        std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lk(mu_);
      queue_.pop_front();
      completed_.push_back(item.lane);
    }
    wake_->wake();
  }
}

ControlThread::ControlThread() {
  if (const char* v = std::getenv("FTHSDP_FTAR_TEST_CORRUPT_CHUNK"); v && *v) {
    char* end = nullptr;
    const long long n = std::strtoll(v, &end, 10);
    if (end && *end == '\0' && n > 0) corrupt_at_ = n;
  }
  wake_fd_ = tcp::Fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!wake_fd_.valid()) throw std::runtime_error(std::string("ftar: eventfd: ") + strerror(errno));
  thread_ = std::thread([this] { loop(); });
}

ControlThread::~ControlThread() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  wake();
  if (thread_.joinable()) thread_.join();
}

void ControlThread::add(const std::shared_ptr<RingEndpoint>& ep) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    endpoints_.push_back(ep);
  }
  wake();
}

void ControlThread::remove(const RingEndpoint* ep) {
  std::lock_guard<std::mutex> lk(mu_);
  endpoints_.erase(std::remove_if(endpoints_.begin(), endpoints_.end(),
                                  [&](const std::shared_ptr<RingEndpoint>& e) { return e.get() == ep; }),
                   endpoints_.end());
}

bool ControlThread::corrupt_this_chunk() {
  if (corrupt_at_ <= 0) return false;
  return chunks_sent_.fetch_add(1) + 1 == corrupt_at_;
}

void ControlThread::wake() {
  const uint64_t one = 1;
  (void)!::write(wake_fd_.get(), &one, sizeof(one));
}

void ControlThread::loop() {
  std::vector<pollfd> fds;
  std::vector<std::shared_ptr<RingEndpoint>> eps;
  std::vector<char> skip;  // endpoints whose poll_prepare threw this pass
  for (;;) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (stop_) break;
      eps = endpoints_;
    }
    auto now = Clock::now();
    Clock::time_point wake_at = now + std::chrono::milliseconds(200);
    fds.clear();
    fds.push_back(pollfd{wake_fd_.get(), POLLIN, 0});
    // An exception here (a sender thread that cannot be created, getrandom failing, memory)
    // fails its endpoint's ring, fatally, with the reason; it must not end this thread, which
    // serves every endpoint, nor the process (std::terminate).
    skip.assign(eps.size(), 0);
    for (size_t i = 0; i < eps.size(); ++i) {
      const size_t mark = fds.size();
      try {
        eps[i]->poll_prepare(now, &fds, &wake_at);
      } catch (...) {
        fds.resize(mark);  // what it registered before throwing is not polled
        skip[i] = 1;
        eps[i]->fail_on_exception(std::current_exception());
      }
    }
    now = Clock::now();
    const auto wait_ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(wake_at - now).count() + 1;
    const int timeout = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(wait_ms, 200)));
    ::poll(fds.data(), fds.size(), timeout);
    if (fds[0].revents & POLLIN) {
      uint64_t v;
      (void)!::read(wake_fd_.get(), &v, sizeof(v));
    }
    now = Clock::now();
    for (size_t i = 0; i < eps.size(); ++i) {
      if (skip[i]) continue;
      try {
        eps[i]->poll_handle(fds, now);
      } catch (...) {
        eps[i]->fail_on_exception(std::current_exception());
      }
    }
  }
}

}  // namespace fthsdp
