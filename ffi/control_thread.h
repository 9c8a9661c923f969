// FTAR's control plane on CPU: one control thread per process owns every
// connection of every ring endpoint (one endpoint per local shard), runs the
// ring schedule over non-blocking sockets, and is what completes the ops that
// XLA's handler threads wait on. Handler threads never touch a socket; they
// submit an op and wait for it (with a deadline).
//
// Data path on CPU: chunks are sent straight from the op's output buffer (it
// is host memory already, so a send-buffer copy would only cost bandwidth)
// by one sender thread per outgoing stream; they are received into S x C
// pre-allocated, pre-faulted staging (reduce-scatter) or straight into the
// output (all-gather) by the control thread, which also reduces.
//
// Outcomes: OK; RECOVERABLE (peer closed or reset, timeout, quorum changed,
// stale quorum id, aborted, not connected, a protocol violation by a
// neighbour) -> the step is retried on a new quorum; FATAL (bad arguments,
// configuration that contradicts the op) -> ffi::Error. A protocol violation
// (a malformed or unauthenticated chunk) is the peer's fault, never ours: the
// op returns RECOVERABLE naming the peer, and the violation is kept for the
// Python side (take_violations) to report to the lighthouse.
//
// Hostile-input limits of a listener (documented constants: they bound what a
// stranger can hold, and no honest peer comes near them): at most
// kMaxPending connections whose handshake is undecided (beyond it the oldest
// one that has not sent its hello, else the oldest held hello, is closed with
// "busy", which an honest sender answers by retrying; else the newcomer is);
// kHandshakeDeadline to send a hello after connecting and to answer a
// challenge; kHeldLimit for a complete hello that waits for this rank's
// configure. Established streams are bounded by `streams` and replaced at
// each configure.
#pragma once

#include <poll.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "crypto/hmac_sha256.h"
#include "reduce.h"
#include "ring_schedule.h"
#include "staging_offload.h"
#include "transport/tcp.h"

namespace fthsdp {

using Clock = std::chrono::steady_clock;

enum class OpStatus : int32_t { kOk = 0, kRecoverable = 1 };

struct RingOptions {
  std::string listen_host = "127.0.0.1";
  int streams = 1;                  // TCP streams per peer; chunks are striped over them
  int64_t chunk_bytes = 1 << 20;    // S
  int chunks = 4;                   // C: chunks in flight (lanes)
  double timeout_s = 60.0;          // deadline of one all-reduce
  int socket_buffer_bytes = 0;      // 0: kernel default (autotuned)
  // The job's FTAR key (derived from the job secret); empty: an explicitly
  // insecure job, no challenge-response and no chunk tags.
  std::string key;
};

// A neighbour broke the protocol (a malformed or unauthenticated chunk).
struct PeerViolation {
  int64_t quorum_id = 0;
  int32_t rank = 0;     // the offender's rank in that quorum
  std::string address;  // its ring address
  std::string reason;
};

struct RingConfig {
  std::string job_id;
  int64_t quorum_id = 0;
  int32_t rank = 0;
  // Ring order; this endpoint's address per member. Only the two neighbours' (rank - 1 and
  // rank + 1, mod the size) are connected to, so only theirs must be addresses: the others may
  // be empty (a process is told only its neighbourhood's endpoints: O(shards), not O(members x
  // shards); see fthsdp.control.quorum.ring_neighbourhood).
  std::vector<std::string> members;
  double connect_timeout_s = 30.0;
  // One all-reduce's deadline in this ring (0: options().timeout_s). A quorum with a member
  // catching up gives its all-reduce longer: that member fetches the state before it joins.
  double op_timeout_s = 0.0;
  // Set by RingEndpoint::configure (the caller's thread): the right neighbour's address,
  // resolved once there, so that the control thread, which serves every endpoint, never
  // blocks in a DNS lookup (a dead resolver stalled it for seconds per retry).
  tcp::Address right_address{};
  std::string resolve_error;  // why right_address could not be resolved ("": it was)
};

// One all-reduce of a contiguous buffer, in place.
struct Op {
  void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t count = 0;
  int64_t quorum_id = 0;
  int32_t rank = 0;
  int32_t n = 0;
  Clock::time_point deadline;
  Clock::time_point started;  // when it was submitted (its timeout message says how long it ran)
  // When set (FTAR on the GPU), the reduce-scatter's additions run on the
  // device: chunks are received into its slots and posted to it.
  ReduceOffload* offload = nullptr;
  // Result, guarded by the endpoint's mutex.
  bool done = false;
  bool fatal = false;
  OpStatus status = OpStatus::kOk;
  std::string reason;
  std::condition_variable cv;
};

struct RingStats {
  int64_t ops_ok = 0;
  int64_t ops_recoverable = 0;
  int64_t ops_fatal = 0;
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
  int64_t configures = 0;
  int64_t refused_handshakes = 0;
  int64_t violations = 0;
  // Time spent tagging (senders) and checking (receiver) chunk headers with a key, since
  // creation: authentication's whole per-chunk cost, measured where it runs.
  int64_t chunk_mac_ns = 0;
  int64_t chunk_macs = 0;
  std::string state;
  std::string last_error;
};

// Where one endpoint is in its all-reduce, for root-cause analysis of stalls
// (which neighbour's data is awaited, how fast each stream carries). A plain
// copy read from relaxed atomics: reading never takes a lock nor waits for
// the control thread, so a process can report it while the ring is stuck.
struct RingProgress {
  bool in_op = false;              // an all-reduce is running on this endpoint
  int64_t op_seq = 0;              // all-reduces begun since the last configure
  int32_t rank = -1;               // this endpoint's rank in the ring (-1: never ran)
  int32_t n = 0;                   // ring size
  int32_t ring_step = 0;           // the step t (0..2n-3) the slowest lane waits to receive
  int32_t ring_steps = 0;          // 2n-2
  int64_t recv_done = 0;           // chunk steps received by the slowest lane
  int64_t recv_total = 0;          // chunk steps per lane in this op
  int64_t sends_queued = 0;        // chunks handed to the senders, not yet on the wire
  double op_s = 0;                 // seconds since the op began (0 when idle)
  double since_recv_s = 0;         // seconds since the last byte came from the left neighbour
  std::vector<int64_t> bytes_sent;      // per outgoing stream (to the right neighbour), cumulative
  std::vector<double> send_busy_s;      // per outgoing stream: seconds its sender had a chunk to send
  std::vector<int64_t> bytes_received;  // per incoming stream (from the left neighbour), cumulative
};

class ControlThread;

// One ring endpoint. Public methods are thread-safe; the private ones run on
// the control thread only.
class RingEndpoint {
 public:
  RingEndpoint(const RingOptions& options, ControlThread* thread);
  ~RingEndpoint();
  RingEndpoint(const RingEndpoint&) = delete;
  RingEndpoint& operator=(const RingEndpoint&) = delete;

  const std::string& address() const { return address_; }
  const RingOptions& options() const { return options_; }
  // Sets the deadline of the all-reduces from now on (0: options().timeout_s), as configure()
  // does, for a quorum that keeps its ring but not its deadline (its behind member caught up).
  void set_op_timeout(double seconds);
  // The deadline of one all-reduce now: the last configure()'s op_timeout_s, else options().
  double op_timeout_s() const {
    const double t = op_timeout_s_.load(std::memory_order_relaxed);
    return t > 0 ? t : options_.timeout_s;
  }

  // Validates (throws std::invalid_argument) and hands the new configuration
  // to the control thread, which tears down the old connections and connects
  // the new neighbours. Returns at once.
  void configure(const RingConfig& config);
  // Waits until the last configure() finished connecting. Returns ok/reason.
  std::pair<bool, std::string> wait_configured(double timeout_s);
  // Makes the in-flight op (if any) return RECOVERABLE promptly and drops the
  // connections; ops fail RECOVERABLE until the next configure().
  void abort(const std::string& reason);
  // Runs one all-reduce (blocking, bounded by op_timeout_s()).
  void run(const std::shared_ptr<Op>& op);
  RingStats stats();
  RingProgress progress() const;  // lock-free (atomics only)
  // Protocol violations seen since the last call (oldest first, at most kMaxViolations kept).
  std::vector<PeerViolation> take_violations();

 private:
  friend class ControlThread;
  enum class State { kUnconfigured, kConnecting, kReady, kFailed };

  static constexpr size_t kMaxViolations = 16;
  static void check_op_timeout(double seconds);  // throws std::invalid_argument
  struct SendItem {
    tcp::ChunkHeader header;
    const char* data;
    size_t bytes;
    int32_t lane;
  };
  // Moves the chunks of one outgoing stream on its own thread, so that sending
  // (a kernel copy per byte on loopback) overlaps the control thread's
  // receiving and reducing. Schedule state stays on the control thread: the
  // sender only reports which lanes' chunks have left.
  // Cumulative per-stream counters (relaxed atomics; read by progress()),
  // both added when a whole chunk has left.
  struct StreamCounters {
    std::atomic<int64_t> bytes{0};
    std::atomic<int64_t> busy_ns{0};
    std::atomic<int64_t> mac_ns{0};  // tagging chunk headers (with a key)
    std::atomic<int64_t> macs{0};
  };
  class Sender {
   public:
    // delay: the throttle test hook (see kSendDelayEnv in control_thread.cc); `key`: the
    // connection's chunk-tag key (empty: untagged).
    Sender(int fd, ControlThread* wake, StreamCounters* counters, Clock::duration delay,
           const crypto::HmacKey& key);
    ~Sender();  // stops and joins the thread
    void push(const SendItem& item);
    // Lanes whose chunk was sent since the last call; false if the stream broke (err set).
    bool take_completed(std::vector<int32_t>* lanes, int* err);
    int64_t take_bytes() { return bytes_.exchange(0); }

   private:
    void loop();
    int fd_;
    ControlThread* wake_;
    StreamCounters* counters_;
    Clock::duration delay_;
    crypto::HmacKey key_;
    uint64_t seq_ = 0;  // chunks sent on this connection (sender thread only)
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<SendItem> queue_;
    std::vector<int32_t> completed_;
    bool stop_ = false;
    bool broken_ = false;
    int err_ = 0;
    std::atomic<int64_t> bytes_{0};
    std::thread thread_;
  };
  struct OutStream {
    enum class Phase { kWaitRetry, kConnecting, kHello, kAwaitReply, kProof, kReady };
    Phase phase = Phase::kWaitRetry;
    tcp::Fd fd;
    Clock::time_point retry_at;
    size_t io_done = 0;
    tcp::Hello hello{};
    tcp::Reply reply{};
    tcp::Proof proof{};
    bool challenged = false;    // the receiver proved the key; our proof is sent or due
    crypto::HmacKey conn_key;   // chunk-tag key of this connection (with a job key)
    std::unique_ptr<Sender> sender;  // declared after fd: stopped before the fd closes
  };
  struct InStream {
    tcp::Fd fd;
    bool reading_payload = false;
    tcp::ChunkHeader header{};
    size_t done = 0;
    char* dest = nullptr;
    int32_t lane = 0;
    int64_t expected = 0;  // messages still due on this stream in the current op
    crypto::HmacKey conn_key;  // chunk-tag key of this connection (with a job key)
    uint64_t seq = 0;          // chunk headers received on this connection
    bool awaiting_slot = false;  // header read, every offload slot taken: not read on
  };
  struct Pending {  // an accepted connection whose handshake is not decided yet
    enum class Phase { kHello, kHeld, kProof };
    Phase phase = Phase::kHello;
    tcp::Fd fd;
    tcp::Hello hello{};
    size_t done = 0;
    Clock::time_point since;
    Clock::time_point deadline;  // of the current phase
    uint8_t nonce[tcp::kNonceBytes] = {};  // ours, sent with the challenge
    tcp::Proof proof{};
    size_t proof_done = 0;
    bool proven = false;  // the peer proved the key for this hello
  };
  struct Lane {
    int64_t next_send = 0;
    int64_t next_recv = 0;     // steps before it are received and summed
    int64_t next_arrive = 0;   // the next step expected on the wire (>= next_recv)
    std::deque<int64_t> reducing;  // steps posted to the offload, not summed yet
    int64_t in_flight = 0;  // queued to the sender, not yet sent
    bool done = false;
  };
  struct Slot {
    int kind;  // 0 listen, 1 pending, 2 out, 3 in
    size_t index;
  };

  // Control-thread side.
  void poll_prepare(Clock::time_point now, std::vector<pollfd>* fds, Clock::time_point* wake_at);
  void poll_handle(const std::vector<pollfd>& fds, Clock::time_point now);
  void take_commands(Clock::time_point now);
  void begin_op();
  void apply_configure(const RingConfig& config, Clock::time_point now);
  void start_op(Clock::time_point now);
  void finish_op(OpStatus status, bool fatal, const std::string& reason);
  void fail(const std::string& reason, bool fatal = false);
  // An exception out of poll_prepare / poll_handle: the ring fails, fatally, with its message.
  void fail_on_exception(std::exception_ptr error) noexcept;
  void close_all();
  void set_state(State s, const std::string& reason);
  void check_ready();
  void on_accept(Clock::time_point now);
  void on_pending(size_t i, short revents, Clock::time_point now);
  // Decides a completed hello: returns 1 accepted, 0 refused (closed), -1 held
  // or challenged (the slot stays free until the peer's proof checks out).
  int decide(Pending* p, Clock::time_point now);
  // A neighbour broke the protocol: recorded for take_violations(); the op fails RECOVERABLE.
  void violation(int32_t rank, const std::string& what);
  void refuse(tcp::Fd fd, const std::string& reason);
  void busy(tcp::Fd fd, const std::string& reason);  // "try again": closes without failing an honest sender
  void on_out(size_t i, short revents, Clock::time_point now);
  void on_in(size_t i, short revents);
  void drain_senders();
  void drain_reduces();
  void advance(int32_t lane);
  void op_maybe_done();
  void note_recv_progress();
  bool configured_locally() const { return cfg_.has_value(); }
  int32_t left() const;
  int32_t right() const;

  RingOptions options_;
  std::atomic<double> op_timeout_s_{0.0};  // RingConfig::op_timeout_s of the last configure()
  crypto::HmacKey key_;  // from options_.key; empty: insecure
  ControlThread* thread_;
  std::string address_;
  tcp::Fd listen_fd_;
  std::vector<char> staging_;  // C * S bytes, pre-faulted

  // Shared with other threads (guarded by mu_).
  std::mutex mu_;
  std::condition_variable state_cv_;
  struct Command {
    bool is_configure;
    RingConfig config;
    std::string reason;
  };
  std::deque<Command> commands_;
  std::shared_ptr<Op> submitted_;
  State state_ = State::kUnconfigured;
  std::string state_reason_;
  uint64_t config_gen_ = 0;   // bumped by configure()
  uint64_t applied_gen_ = 0;  // the generation state_ describes
  RingStats stats_;
  std::vector<PeerViolation> violations_;

  // Control-thread private.
  std::optional<RingConfig> cfg_;
  Clock::time_point connect_deadline_;
  Clock::time_point accept_paused_until_{};  // out of descriptors: the listener is not polled until then
  std::vector<OutStream> out_;
  std::vector<InStream> in_;
  std::vector<Pending> pending_;
  std::vector<Slot> slots_;
  size_t slot_base_ = 0;
  std::shared_ptr<Op> op_;
  std::optional<RingSchedule> sched_;
  std::vector<Lane> lanes_;
  size_t elem_ = 4;
  uint64_t op_seq_ = 0;
  int64_t lanes_done_ = 0;
  State local_state_ = State::kUnconfigured;
  std::string local_reason_;
  uint64_t epoch_ = 0;  // bumped whenever connections are dropped

  // Progress (written on the control and sender threads, read anywhere).
  static constexpr int kMaxStreams = 64;
  Clock::duration send_delay_{0};  // the throttle test hook; 0 = off
  std::atomic<bool> p_in_op_{false};
  std::atomic<int64_t> p_op_seq_{0};
  std::atomic<int32_t> p_rank_{-1};
  std::atomic<int32_t> p_n_{0};
  std::atomic<int32_t> p_ring_step_{0};
  std::atomic<int64_t> p_recv_done_{0};
  std::atomic<int64_t> p_recv_total_{0};
  std::atomic<int64_t> p_sends_queued_{0};
  std::atomic<int64_t> p_op_start_ns_{0};
  std::atomic<int64_t> p_last_recv_ns_{0};
  std::array<StreamCounters, kMaxStreams> p_out_{};
  std::atomic<int64_t> p_check_mac_ns_{0};  // checking received chunk headers (control thread)
  std::atomic<int64_t> p_check_macs_{0};
  std::array<std::atomic<int64_t>, kMaxStreams> p_in_bytes_{};
};

// The per-process thread that drives every endpoint.
class ControlThread {
 public:
  ControlThread();
  ~ControlThread();
  ControlThread(const ControlThread&) = delete;
  ControlThread& operator=(const ControlThread&) = delete;

  void add(const std::shared_ptr<RingEndpoint>& ep);
  void remove(const RingEndpoint* ep);
  void wake();
  // Test hook, off unless FTHSDP_FTAR_TEST_CORRUPT_CHUNK=N (N >= 1) is set in
  // the process's environment: true for the N-th chunk header this process
  // sends (that sender flips a bit of it), so a test can make one replica
  // misbehave on the wire.
  bool corrupt_this_chunk();

 private:
  void loop();
  int64_t corrupt_at_ = 0;  // 0: the hook is off
  std::atomic<int64_t> chunks_sent_{0};

  std::mutex mu_;
  std::vector<std::shared_ptr<RingEndpoint>> endpoints_;
  bool stop_ = false;
  tcp::Fd wake_fd_;
  std::thread thread_;
};

}  // namespace fthsdp
