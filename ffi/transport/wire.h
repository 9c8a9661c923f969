// FTAR's wire format as pure functions: decoding and checking the fixed
// records a peer sends (Hello, Reply, ChunkHeader) and the "host:port" syntax,
// with no sockets, no threads and no state of their own.
//
// Everything a neighbour can put on the wire reaches the control thread through
// these functions, which is what makes them fuzzable one by one (ffi/fuzz/):
// each takes the received record and a plain description of what the receiver
// expects, and returns a verdict with the exact refusal reason the control
// thread reports.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "crypto/hmac_sha256.h"
#include "ring_schedule.h"
#include "transport/tcp.h"

namespace fthsdp::wire {

// A fixed record from raw bytes: false (and *out untouched) unless `len` is
// exactly the record's size. The records are packed PODs, so any bytes of the
// right length decode; the check functions below decide what they mean.
bool decode_hello(const void* data, size_t len, tcp::Hello* out);
bool decode_reply(const void* data, size_t len, tcp::Reply* out);
bool decode_chunk_header(const void* data, size_t len, tcp::ChunkHeader* out);
bool decode_proof(const void* data, size_t len, tcp::Proof* out);

// A NUL-padded fixed-size text field as a string; never reads past the field,
// whether or not the peer terminated it.
std::string fixed_str(const char* field, size_t size);
template <size_t N>
std::string fixed_str(const char (&field)[N]) {
  return fixed_str(field, N);
}

// Writes `s` into a fixed field, truncated to N-1 bytes and NUL-padded.
template <size_t N>
void put_fixed_str(char (&dst)[N], const std::string& s) {
  std::memset(dst, 0, N);
  std::memcpy(dst, s.data(), s.size() < N - 1 ? s.size() : N - 1);
}

// The hello a sender puts at the start of stream `stream`. `auth`: the sender
// holds a job key; `nonce` (kNonceBytes, or null for zeros) its fresh nonce.
tcp::Hello make_hello(const std::string& job_id, int64_t quorum_id, int32_t rank, int32_t n,
                      int32_t stream, int32_t streams, bool auth = false, const uint8_t* nonce = nullptr);
// The reply to a hello (reason truncated to the field).
tcp::Reply make_reply(bool ok, const std::string& reason);
// "Busy, try again": the listener closed this connection to bound its pending
// handshakes (reason truncated to the field); an honest sender retries.
tcp::Reply make_busy(const std::string& reason);

// What a receiving rank knows when a hello arrives.
struct HelloExpect {
  bool configured = false;  // false: no ring yet; a well-formed hello is held until configure
  std::string job_id;
  int64_t quorum_id = 0;
  int32_t rank = 0;
  int32_t n = 0;        // ring size
  int32_t left = 0;     // rank of this rank's left neighbour
  int32_t streams = 0;  // streams per peer (this rank's option)
  std::vector<bool> taken;  // one per incoming stream slot: already connected
  bool failed = false;      // this rank's ring for quorum_id already failed
  std::string failed_reason;
  bool auth = false;        // this rank holds a job key: the peer must hold one too
};

enum class HelloVerdict {
  kAccept,  // the stream takes slot `hello.stream`
  kRefuse,  // reply with `reason` and close
  kHold,    // keep the connection until this rank is (re)configured
};

struct HelloDecision {
  HelloVerdict verdict = HelloVerdict::kRefuse;
  std::string reason;  // set for kRefuse
};

HelloDecision check_hello(const tcp::Hello& hello, const HelloExpect& expect);

// A reply as the sender reads it.
struct ReplyDecision {
  bool accepted = false;
  bool challenge = false;  // the receiver asks for a proof (nonce and MAC set)
  bool busy = false;       // the receiver is full: retry (reason says why)
  std::string reason;      // the receiver's refusal reason (empty unless refused)
};
ReplyDecision read_reply(const tcp::Reply& reply);

// ---- The challenge-response (with a job key) ------------------------------
//
// Both proofs are HMAC-SHA256 under the job's FTAR key over the whole hello
// (job id, quorum id, sender rank, ring size, stream, streams, the sender's
// nonce) and the receiver's nonce, each under its own label, so neither side's
// proof can be replayed as the other's and none outlives its connection (a
// fresh nonce on each side). The receiver proves first, over the sender's
// nonce; the sender proves over the receiver's; only then does the stream take
// a slot. MACs are compared in constant time.

// The receiver's challenge: kReplyChallenge, its nonce and its proof.
tcp::Reply make_challenge(const crypto::HmacKey& key, const tcp::Hello& hello, const uint8_t* nonce_r);
// The sender checks the receiver's proof against the hello it sent.
bool check_challenge(const crypto::HmacKey& key, const tcp::Hello& sent, const tcp::Reply& challenge);
// The sender's proof over the receiver's nonce.
tcp::Proof make_proof(const crypto::HmacKey& key, const tcp::Hello& sent, const uint8_t* nonce_r);
// The receiver checks the sender's proof (magic and MAC).
bool check_proof(const crypto::HmacKey& key, const tcp::Hello& hello, const uint8_t* nonce_r,
                 const tcp::Proof& proof);
// The key of one connection's chunk tags, derived from the same transcript.
crypto::HmacKey connection_key(const crypto::HmacKey& key, const tcp::Hello& hello, const uint8_t* nonce_r);

// A chunk header's tag: MAC (truncated to kTagBytes) of its fields and `seq`,
// the count of chunks sent before it on this connection (so a header cannot
// be replayed, dropped or reordered unnoticed).
void tag_chunk(const crypto::HmacKey& conn_key, uint64_t seq, tcp::ChunkHeader* header);
bool check_chunk_tag(const crypto::HmacKey& conn_key, uint64_t seq, const tcp::ChunkHeader& header);

// What a receiving stream expects of the next chunk header.
struct ChunkExpect {
  uint64_t op_seq = 0;      // ops since configure on this rank
  size_t lanes = 0;         // lanes of the current op
  int32_t streams = 1;      // streams per peer; lane l travels on stream l % streams
  size_t stream = 0;        // the stream the header arrived on
  std::function<int64_t(uint32_t lane)> next_recv;  // the lane's next expected step (lane < lanes)
  const RingSchedule* schedule = nullptr;  // the current op's schedule (required)
  size_t elem = 4;                         // bytes per element
};

struct ChunkDecision {
  bool ok = false;
  std::string error;  // what is wrong, when !ok (the control thread prefixes the peer)
  ChunkStep step;     // the schedule's step this chunk belongs to, when ok
};

ChunkDecision check_chunk_header(const tcp::ChunkHeader& header, const ChunkExpect& expect);

// "host:port" or "[ipv6]:port" -> host (without brackets) and port (0..65535;
// the host is not resolved). False with `error` set when the text is not of
// that form (an unbracketed IPv6 literal is refused: its last colon is ambiguous).
bool split_host_port(const std::string& address, std::string* host, long* port, std::string* error);
// The inverse: brackets around a host that contains ':' (an IPv6 literal).
std::string join_host_port(const std::string& host, long port);

}  // namespace fthsdp::wire
