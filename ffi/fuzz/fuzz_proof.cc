// libFuzzer harness: FTAR's challenge-response and chunk tags (wire.h), as
// each side judges what a (possibly hostile) peer sent.
//
// Input: a hello record, a reply record (the receiver's challenge as the
// sender reads it), a proof record (the sender's proof as the receiver reads
// it), a chunk header, then a key, a receiver nonce and a chunk sequence
// number. Flags let the records be the honest ones with a few bytes flipped,
// so the checks see near-misses, not only noise.
//
// Properties: nothing crashes; check_challenge, check_proof and
// check_chunk_tag accept exactly the record the key holder would have made
// (any other MAC, magic, nonce, sequence number or field is refused); the
// honest handshake round-trips; the two proofs of one transcript differ (a
// receiver's proof cannot be replayed as a sender's); another key fails.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstring>
#include <string>

#include "crypto/hmac_sha256.h"
#include "fuzz_check.h"
#include "transport/wire.h"

using namespace fthsdp;

namespace {

template <typename T>
bool same(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  constexpr size_t kRecords = sizeof(tcp::Hello) + sizeof(tcp::Reply) + sizeof(tcp::Proof) + sizeof(tcp::ChunkHeader);
  if (size < kRecords) return 0;
  tcp::Hello hello;
  tcp::Reply reply;
  tcp::Proof proof;
  tcp::ChunkHeader header;
  const uint8_t* p = data;
  FUZZ_CHECK(wire::decode_hello(p, sizeof(hello), &hello));
  p += sizeof(hello);
  FUZZ_CHECK(wire::decode_reply(p, sizeof(reply), &reply));
  p += sizeof(reply);
  FUZZ_CHECK(wire::decode_proof(p, sizeof(proof), &proof));
  FUZZ_CHECK(!wire::decode_proof(p, sizeof(proof) + 1, &proof));
  p += sizeof(proof);
  FUZZ_CHECK(wire::decode_chunk_header(p, sizeof(header), &header));
  FuzzedDataProvider fdp(data + kRecords, size - kRecords);

  const uint8_t flags = fdp.ConsumeIntegral<uint8_t>();
  std::string key_bytes = fdp.ConsumeRandomLengthString(100);
  if (key_bytes.empty()) key_bytes = "k";
  const crypto::HmacKey key(key_bytes);
  uint8_t nonce_r[tcp::kNonceBytes] = {};
  for (auto& b : nonce_r) b = fdp.ConsumeIntegral<uint8_t>();
  const uint64_t seq = fdp.ConsumeIntegral<uint64_t>();
  const size_t flip = fdp.ConsumeIntegral<uint16_t>();

  const tcp::Reply honest_challenge = wire::make_challenge(key, hello, nonce_r);
  const tcp::Proof honest_proof = wire::make_proof(key, hello, nonce_r);
  const crypto::HmacKey conn = wire::connection_key(key, hello, nonce_r);
  tcp::ChunkHeader honest_header = header;
  wire::tag_chunk(conn, seq, &honest_header);

  // Near-misses: the honest record with one byte flipped (or left intact).
  auto near = [&](auto honest, auto* out) {
    *out = honest;
    if (flags & 0x80) {
      auto* bytes = reinterpret_cast<uint8_t*>(out);
      bytes[flip % sizeof(*out)] ^= static_cast<uint8_t>(1 + (flip >> 8) % 255);
    }
  };
  if (flags & 1) near(honest_challenge, &reply);
  if (flags & 2) near(honest_proof, &proof);
  if (flags & 4) near(honest_header, &header);

  // The sender's check of the challenge: only the receiver's exact proof passes.
  const bool challenge_ok = wire::check_challenge(key, hello, reply);
  if (challenge_ok) {
    FUZZ_CHECK(reply.ok == tcp::kReplyChallenge);
    // The MAC covers the nonce the reply carries: it is what the receiver would have sent.
    const tcp::Reply remade = wire::make_challenge(key, hello, reply.nonce);
    FUZZ_CHECK(std::memcmp(remade.mac, reply.mac, tcp::kMacBytes) == 0);
  }
  const wire::ReplyDecision rd = wire::read_reply(reply);
  if (challenge_ok) FUZZ_CHECK(rd.challenge && !rd.accepted);

  // The receiver's check of the proof: only the sender's exact proof passes.
  const bool proof_ok = wire::check_proof(key, hello, nonce_r, proof);
  FUZZ_CHECK(proof_ok == same(proof, honest_proof));

  // Chunk tags: only the exact header under this connection and sequence number.
  const bool tag_ok = wire::check_chunk_tag(conn, seq, header);
  FUZZ_CHECK(tag_ok == same(header, honest_header));
  FUZZ_CHECK(!wire::check_chunk_tag(conn, seq + 1, honest_header));

  // The honest handshake round-trips; the two directions' proofs differ; another key fails.
  FUZZ_CHECK(wire::check_challenge(key, hello, honest_challenge));
  FUZZ_CHECK(wire::check_proof(key, hello, nonce_r, honest_proof));
  FUZZ_CHECK(std::memcmp(honest_challenge.mac, honest_proof.mac, tcp::kMacBytes) != 0);
  const crypto::HmacKey other(key_bytes + "x");
  FUZZ_CHECK(!wire::check_proof(other, hello, nonce_r, honest_proof));
  FUZZ_CHECK(!wire::check_challenge(other, hello, honest_challenge));
  return 0;
}
