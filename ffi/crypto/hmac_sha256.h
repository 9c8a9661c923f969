// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), small and dependency-free:
// the keyed MACs of FTAR's handshake and chunk headers (ffi/transport/wire.h).
//
// Written here rather than linked from OpenSSL because libcrypto is not a
// dependency of the native library (CMake or Bazel) and one MAC does not
// justify a new system package. Checked against the FIPS 180-4 example
// digests and the RFC 4231 HMAC test cases (ffi/tests/hmac_sha256_test.cc).
//
// Speed matters only for chunk headers: HmacKey absorbs the padded key once,
// so a MAC of a message shorter than 56 bytes costs two compressions.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace fthsdp::crypto {

constexpr size_t kDigestBytes = 32;
using Digest = std::array<uint8_t, kDigestBytes>;

// Incremental SHA-256.
class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t len);
  Digest finish();  // the object must not be updated afterwards

 private:
  void compress(const uint8_t* block);
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t buf_len_ = 0;
  uint64_t total_ = 0;  // bytes absorbed
};

Digest sha256(const void* data, size_t len);

// An HMAC-SHA256 key with its inner and outer pads already absorbed.
class HmacKey {
 public:
  HmacKey();  // the empty key (valid, but callers use empty() to mean "no key")
  HmacKey(const void* key, size_t len);
  explicit HmacKey(const std::string& key) : HmacKey(key.data(), key.size()) {}

  bool empty() const { return empty_; }
  // MAC of the concatenation of up to three parts (null parts are skipped).
  Digest mac(const void* a, size_t a_len, const void* b = nullptr, size_t b_len = 0,
             const void* c = nullptr, size_t c_len = 0) const;

 private:
  Sha256 inner_;
  Sha256 outer_;
  bool empty_ = true;
};

Digest hmac_sha256(const void* key, size_t key_len, const void* data, size_t len);

// Equality of two byte strings in time that depends only on `len`.
bool equal_ct(const void* a, const void* b, size_t len);

// Fills `out` from the kernel's CSPRNG (getrandom); throws std::runtime_error
// if the kernel cannot supply randomness.
void random_bytes(void* out, size_t len);

std::string to_hex(const uint8_t* data, size_t len);

}  // namespace fthsdp::crypto
