// TCP transport for FTAR: the only code that knows about sockets.
//
// Connections are unidirectional streams: a rank opens `streams` connections
// to its right neighbour and accepts as many from its left one. Every stream
// starts with a fixed-size handshake that carries the job id, the quorum id,
// the sender's rank and a fresh nonce. With a job key (the job secret's FTAR
// key) it is a mutual challenge-response (ffi/transport/wire.h):
//
//   sender -> Hello(nonce_c)                   receiver checks the fields
//   receiver -> Reply(kChallenge, nonce_s, MAC_r)   MAC_r proves the receiver
//   sender -> Proof(MAC_s)                     MAC_s proves the sender
//   receiver -> Reply(kAccepted) and the stream takes its slot
//
// Without a key (an explicitly insecure job) the receiver answers the Hello
// with kAccepted at once, as protocol version 1 did. After the handshake a
// stream carries chunks, each behind a fixed ChunkHeader that says which op,
// lane and step it belongs to, so that the receiver can check it against its
// own schedule (a mismatch is a protocol violation, never silently mixed
// data); with a key the header also carries a MAC under a per-connection key
// and the stream's chunk sequence number.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace fthsdp::tcp {

constexpr uint32_t kHelloMagic = 0x46544152;  // "FTAR"
constexpr uint32_t kChunkMagic = 0x4348554e;  // "CHUN"
constexpr uint32_t kProofMagic = 0x50524f46;  // "PROF"
constexpr uint32_t kProtocolVersion = 2;      // 2: nonces, proofs, chunk tags
constexpr size_t kJobIdMax = 64;
constexpr size_t kReasonMax = 192;
constexpr size_t kNonceBytes = 16;
constexpr size_t kMacBytes = 32;  // HMAC-SHA256
constexpr size_t kTagBytes = 16;  // a chunk header's MAC, truncated (RFC 2104, section 5)

// Reply::ok
constexpr uint32_t kReplyRefused = 0;
constexpr uint32_t kReplyAccepted = 1;
constexpr uint32_t kReplyChallenge = 2;
constexpr uint32_t kReplyBusy = 3;  // the listener is full: reason set, the sender retries

#pragma pack(push, 1)
struct Hello {
  uint32_t magic;
  uint32_t version;
  int64_t quorum_id;
  int32_t rank;     // sender's rank
  int32_t n;        // sender's ring size
  int32_t stream;   // which of the `streams` connections this is
  int32_t streams;  // sender's streams per peer
  char job_id[kJobIdMax];
  uint32_t auth;                 // 1: the sender holds a job key and will prove it
  uint8_t nonce[kNonceBytes];    // the sender's fresh nonce
};
struct Reply {
  uint32_t ok;  // kReplyRefused (reason set), kReplyAccepted, kReplyChallenge, kReplyBusy (reason set)
  char reason[kReasonMax];
  uint8_t nonce[kNonceBytes];  // kReplyChallenge: the receiver's fresh nonce
  uint8_t mac[kMacBytes];      // kReplyChallenge: the receiver's proof
};
struct Proof {
  uint32_t magic;
  uint8_t mac[kMacBytes];  // the sender's proof
};
struct ChunkHeader {
  uint32_t magic;
  uint32_t lane;
  uint64_t op_seq;   // ops since configure, counted the same on every rank
  int64_t index;     // lane step index (partition * (2n-2) + step)
  uint64_t bytes;    // payload bytes that follow
  uint8_t tag[kTagBytes];  // with a key: MAC of the fields above and the stream's chunk count
};
#pragma pack(pop)

// Owns one file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = o.release();
    }
    return *this;
  }
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  void reset();

 private:
  int fd_ = -1;
};

// A resolved IPv4 or IPv6 socket address.
struct Address {
  sockaddr_storage storage{};
  socklen_t len = 0;
  int family() const { return storage.ss_family; }
  const sockaddr* get() const { return reinterpret_cast<const sockaddr*>(&storage); }
};

// "host:port" or "[ipv6]:port" -> socket address (a name resolves to its first
// address of either family). Returns false with `error` set.
bool parse_address(const std::string& address, Address* out, std::string* error);
// host:port, with brackets around an IPv6 host.
std::string format_address(const sockaddr* addr);

// Listening socket on host:port (port 0: the OS picks one). `bound` gets the
// address peers should connect to. Throws std::runtime_error on failure.
Fd listen_on(const std::string& host, int port, std::string* bound);

// Starts a non-blocking connect. Returns an invalid Fd and sets `error` when
// the attempt failed at once (for example: connection refused).
Fd connect_start(const Address& addr, int* error);
// After POLLOUT on a connecting socket: 0 if connected, else the errno.
int connect_result(int fd);

// Accepts one pending connection (non-blocking); invalid Fd when none.
Fd accept_one(int listen_fd);

// TCP_NODELAY, large socket buffers, non-blocking.
void tune_stream(int fd, int buffer_bytes);

// Outcome of one non-blocking I/O attempt.
enum class Io { kProgress, kWouldBlock, kClosed, kError };

// Sends from up to two buffers (header + payload); advances *done.
Io send_two(int fd, const void* a, size_t a_len, const void* b, size_t b_len, size_t* done,
            int* err);
// Receives into buf[*done .. len); advances *done.
Io recv_into(int fd, void* buf, size_t len, size_t* done, int* err);

}  // namespace fthsdp::tcp
