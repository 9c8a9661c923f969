#include "transport/wire.h"

#include <cstdlib>

namespace fthsdp::wire {
namespace {

template <typename T>
bool decode(const void* data, size_t len, T* out) {
  if (data == nullptr || len != sizeof(T)) return false;
  std::memcpy(out, data, sizeof(T));
  return true;
}

}  // namespace

bool decode_hello(const void* data, size_t len, tcp::Hello* out) { return decode(data, len, out); }
bool decode_reply(const void* data, size_t len, tcp::Reply* out) { return decode(data, len, out); }
bool decode_chunk_header(const void* data, size_t len, tcp::ChunkHeader* out) {
  return decode(data, len, out);
}
bool decode_proof(const void* data, size_t len, tcp::Proof* out) { return decode(data, len, out); }

std::string fixed_str(const char* field, size_t size) { return std::string(field, strnlen(field, size)); }

tcp::Hello make_hello(const std::string& job_id, int64_t quorum_id, int32_t rank, int32_t n,
                      int32_t stream, int32_t streams, bool auth, const uint8_t* nonce) {
  tcp::Hello h{};
  h.magic = tcp::kHelloMagic;
  h.version = tcp::kProtocolVersion;
  h.quorum_id = quorum_id;
  h.rank = rank;
  h.n = n;
  h.stream = stream;
  h.streams = streams;
  put_fixed_str(h.job_id, job_id);
  h.auth = auth ? 1 : 0;
  if (nonce) std::memcpy(h.nonce, nonce, tcp::kNonceBytes);
  return h;
}

tcp::Reply make_reply(bool ok, const std::string& reason) {
  tcp::Reply r{};
  r.ok = ok ? 1 : 0;
  put_fixed_str(r.reason, reason);
  return r;
}

tcp::Reply make_busy(const std::string& reason) {
  tcp::Reply r = make_reply(false, reason);
  r.ok = tcp::kReplyBusy;
  return r;
}

HelloDecision check_hello(const tcp::Hello& h, const HelloExpect& e) {
  auto refuse = [](std::string why) { return HelloDecision{HelloVerdict::kRefuse, std::move(why)}; };
  if (h.magic != tcp::kHelloMagic || h.version != tcp::kProtocolVersion) {
    return refuse("not an FTAR peer or protocol version mismatch");
  }
  if (h.auth > 1) return refuse("bad auth flag " + std::to_string(h.auth));
  if (e.auth && h.auth == 0) {
    return refuse("peer sent no proof of the job secret and this rank requires one "
                  "(start every replica of the job with the same secret)");
  }
  if (!e.auth && h.auth == 1) {
    return refuse("peer holds a job secret and this rank runs without one (insecure); "
                  "start every replica of the job with the same secret");
  }
  if (!e.configured) return {HelloVerdict::kHold, ""};
  const std::string job = fixed_str(h.job_id);
  if (job != e.job_id) {
    return refuse("job id mismatch: peer is in job '" + job + "', this rank in job '" + e.job_id + "'");
  }
  if (h.quorum_id < e.quorum_id) {
    return refuse("stale quorum id " + std::to_string(h.quorum_id) +
                  ": this rank is configured for quorum " + std::to_string(e.quorum_id));
  }
  if (h.quorum_id > e.quorum_id) return {HelloVerdict::kHold, ""};  // this rank will be reconfigured soon
  if (e.failed) {
    return refuse("this rank's ring for quorum " + std::to_string(e.quorum_id) + " already failed (" +
                  e.failed_reason + "); reconfigure with a new quorum id");
  }
  if (h.n != e.n) {
    return refuse("ring size mismatch: peer says " + std::to_string(h.n) + ", this rank " +
                  std::to_string(e.n));
  }
  if (e.n < 2 || h.rank != e.left) {
    return refuse("rank " + std::to_string(h.rank) + " is not this rank's left neighbour (rank " +
                  std::to_string(e.rank) + " of " + std::to_string(e.n) + ")");
  }
  if (h.streams != e.streams) {
    return refuse("streams per peer mismatch: peer uses " + std::to_string(h.streams) + ", this rank " +
                  std::to_string(e.streams));
  }
  if (h.stream < 0 || h.stream >= e.streams || static_cast<size_t>(h.stream) >= e.taken.size() ||
      e.taken[static_cast<size_t>(h.stream)]) {
    return refuse("bad or duplicate stream index " + std::to_string(h.stream));
  }
  return {HelloVerdict::kAccept, ""};
}

ReplyDecision read_reply(const tcp::Reply& reply) {
  ReplyDecision d;
  d.accepted = reply.ok == tcp::kReplyAccepted;
  d.challenge = reply.ok == tcp::kReplyChallenge;
  d.busy = reply.ok == tcp::kReplyBusy;
  if (!d.accepted && !d.challenge) {
    d.reason = reply.ok == tcp::kReplyRefused || d.busy
                   ? fixed_str(reply.reason)
                   : "malformed reply (code " + std::to_string(reply.ok) + ")";
    if (d.reason.empty()) d.reason = "refused without a reason";
  }
  return d;
}

namespace {

constexpr char kLabelReceiver[] = "fthsdp ftar v2 receiver proof";
constexpr char kLabelSender[] = "fthsdp ftar v2 sender proof";
constexpr char kLabelChunks[] = "fthsdp ftar v2 chunk key";

crypto::Digest transcript_mac(const crypto::HmacKey& key, const char* label, const tcp::Hello& hello,
                              const uint8_t* nonce_r) {
  return key.mac(label, std::strlen(label) + 1, &hello, sizeof(hello), nonce_r, tcp::kNonceBytes);
}

struct TaggedFields {  // what a chunk tag covers, in a fixed layout
  uint64_t seq;
  uint32_t magic;
  uint32_t lane;
  uint64_t op_seq;
  int64_t index;
  uint64_t bytes;
};

crypto::Digest chunk_mac(const crypto::HmacKey& conn_key, uint64_t seq, const tcp::ChunkHeader& h) {
  const TaggedFields f{seq, h.magic, h.lane, h.op_seq, h.index, h.bytes};
  return conn_key.mac(&f, sizeof(f));
}

}  // namespace

tcp::Reply make_challenge(const crypto::HmacKey& key, const tcp::Hello& hello, const uint8_t* nonce_r) {
  tcp::Reply r{};
  r.ok = tcp::kReplyChallenge;
  std::memcpy(r.nonce, nonce_r, tcp::kNonceBytes);
  const crypto::Digest mac = transcript_mac(key, kLabelReceiver, hello, nonce_r);
  std::memcpy(r.mac, mac.data(), tcp::kMacBytes);
  return r;
}

bool check_challenge(const crypto::HmacKey& key, const tcp::Hello& sent, const tcp::Reply& challenge) {
  if (challenge.ok != tcp::kReplyChallenge) return false;
  const crypto::Digest mac = transcript_mac(key, kLabelReceiver, sent, challenge.nonce);
  return crypto::equal_ct(mac.data(), challenge.mac, tcp::kMacBytes);
}

tcp::Proof make_proof(const crypto::HmacKey& key, const tcp::Hello& sent, const uint8_t* nonce_r) {
  tcp::Proof p{};
  p.magic = tcp::kProofMagic;
  const crypto::Digest mac = transcript_mac(key, kLabelSender, sent, nonce_r);
  std::memcpy(p.mac, mac.data(), tcp::kMacBytes);
  return p;
}

bool check_proof(const crypto::HmacKey& key, const tcp::Hello& hello, const uint8_t* nonce_r,
                 const tcp::Proof& proof) {
  const crypto::Digest mac = transcript_mac(key, kLabelSender, hello, nonce_r);
  const bool mac_ok = crypto::equal_ct(mac.data(), proof.mac, tcp::kMacBytes);
  return mac_ok && proof.magic == tcp::kProofMagic;
}

crypto::HmacKey connection_key(const crypto::HmacKey& key, const tcp::Hello& hello, const uint8_t* nonce_r) {
  const crypto::Digest k = transcript_mac(key, kLabelChunks, hello, nonce_r);
  return crypto::HmacKey(k.data(), k.size());
}

void tag_chunk(const crypto::HmacKey& conn_key, uint64_t seq, tcp::ChunkHeader* header) {
  const crypto::Digest mac = chunk_mac(conn_key, seq, *header);
  std::memcpy(header->tag, mac.data(), tcp::kTagBytes);
}

bool check_chunk_tag(const crypto::HmacKey& conn_key, uint64_t seq, const tcp::ChunkHeader& header) {
  const crypto::Digest mac = chunk_mac(conn_key, seq, header);
  return crypto::equal_ct(mac.data(), header.tag, tcp::kTagBytes);
}

ChunkDecision check_chunk_header(const tcp::ChunkHeader& h, const ChunkExpect& e) {
  ChunkDecision d;
  if (h.magic != tcp::kChunkMagic) {
    d.error = "bad chunk magic";
  } else if (h.op_seq != e.op_seq) {
    d.error = "chunk of op " + std::to_string(h.op_seq) + " during op " + std::to_string(e.op_seq);
  } else if (h.lane >= e.lanes || e.streams < 1 ||
             static_cast<int>(h.lane % static_cast<uint32_t>(e.streams)) != static_cast<int>(e.stream)) {
    d.error = "chunk of lane " + std::to_string(h.lane) + " on stream " + std::to_string(e.stream);
  } else if (const int64_t want = e.next_recv(h.lane); h.index != want) {
    d.error = "lane " + std::to_string(h.lane) + " expected step " + std::to_string(want) + ", got " +
              std::to_string(h.index);
  } else if (h.index < 0 || h.index >= e.schedule->steps_per_lane()) {
    // A finished lane expects nothing more: a chunk "at" its end is not in the schedule.
    d.error = "chunk at step " + std::to_string(h.index) + " of lane " + std::to_string(h.lane) +
              ", which has only " + std::to_string(e.schedule->steps_per_lane()) + " steps";
  } else {
    d.step = e.schedule->lane_step(static_cast<int32_t>(h.lane), h.index);
    const uint64_t expect_bytes = static_cast<uint64_t>(d.step.recv.count) * e.elem;
    if (h.bytes != expect_bytes) {
      d.error = "chunk of " + std::to_string(h.bytes) + " bytes where the schedule says " +
                std::to_string(d.step.recv.count * static_cast<int64_t>(e.elem)) +
                " (do both ranks all-reduce buffers of the same size and dtype?)";
    } else {
      d.ok = true;
    }
  }
  return d;
}

bool split_host_port(const std::string& address, std::string* host, long* port, std::string* error) {
  // "host:port", or "[v6]:port" for IPv6 literals (the brackets keep the
  // address's own colons apart from the port's, as in URLs, RFC 3986).
  std::string h;
  size_t colon = std::string::npos;
  if (!address.empty() && address[0] == '[') {
    const auto close = address.find(']');
    if (close == std::string::npos || close == 1 || close + 1 >= address.size() || address[close + 1] != ':') {
      *error = "address '" + address + "' is not [ipv6]:port";
      return false;
    }
    h = address.substr(1, close - 1);
    if (h.find_first_of("[]") != std::string::npos || h.find(':') == std::string::npos) {
      *error = "address '" + address + "': only IPv6 literals go in brackets";
      return false;
    }
    colon = close + 1;
  } else {
    colon = address.rfind(':');
    if (colon == std::string::npos || colon == 0) {
      *error = "address '" + address + "' is not host:port";
      return false;
    }
    h = address.substr(0, colon);
    if (h.find(':') != std::string::npos || h.find_first_of("[]") != std::string::npos) {
      *error = "address '" + address + "' is not host:port (write IPv6 literals as [addr]:port)";
      return false;
    }
  }
  if (colon + 1 == address.size()) {
    *error = "address '" + address + "' has no port";
    return false;
  }
  const std::string port_s = address.substr(colon + 1);
  for (const char c : port_s) {
    if (c < '0' || c > '9') {
      *error = "address '" + address + "' has a bad port";
      return false;
    }
  }
  if (port_s.size() > 5) {
    *error = "address '" + address + "' has a bad port";
    return false;
  }
  const long p = std::strtol(port_s.c_str(), nullptr, 10);
  if (p < 0 || p > 65535) {
    *error = "address '" + address + "' has a bad port";
    return false;
  }
  *host = h;
  *port = p;
  return true;
}

std::string join_host_port(const std::string& host, long port) {
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

}  // namespace fthsdp::wire
