// C++ test of ffi/crypto/hmac_sha256: SHA-256 against the FIPS 180-4 example
// messages (and the classic one-million-'a' message), HMAC-SHA256 against
// RFC 4231's test cases 1-7 (case 5 truncated to 128 bits, as chunk tags
// are), incremental hashing split at every offset equal to one-shot hashing,
// and the constant-time comparison. Exit status 0 on success.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "crypto/hmac_sha256.h"

namespace {

using fthsdp::crypto::Digest;
using fthsdp::crypto::to_hex;

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  }
}

std::string hex(const Digest& d, size_t n = 32) { return to_hex(d.data(), n); }

void sha256_vectors() {
  struct Case {
    std::string msg;
    const char* want;
  };
  const Case cases[] = {
      {"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"},
      {"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
      {"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
       "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"},
      {std::string(1000000, 'a'), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"},
  };
  for (const auto& c : cases) {
    const std::string got = hex(fthsdp::crypto::sha256(c.msg.data(), c.msg.size()));
    check(got == c.want, "sha256 of a " + std::to_string(c.msg.size()) + "-byte message: " + got);
  }
  // Incremental == one-shot, for every split of a message spanning block boundaries.
  std::string msg;
  for (int i = 0; i < 200; ++i) msg.push_back(static_cast<char>(i * 7 + 3));
  const Digest whole = fthsdp::crypto::sha256(msg.data(), msg.size());
  for (size_t cut = 0; cut <= msg.size(); ++cut) {
    fthsdp::crypto::Sha256 s;
    s.update(msg.data(), cut);
    s.update(msg.data() + cut, msg.size() - cut);
    check(s.finish() == whole, "sha256 split at " + std::to_string(cut));
  }
}

void hmac_vectors() {
  struct Case {
    std::string key;
    std::string data;
    const char* want;
    size_t bytes;
  };
  std::string key4;
  for (int i = 1; i <= 25; ++i) key4.push_back(static_cast<char>(i));
  const Case cases[] = {
      {std::string(20, '\x0b'), "Hi There", "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7", 32},
      {"Jefe", "what do ya want for nothing?",
       "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843", 32},
      {std::string(20, '\xaa'), std::string(50, '\xdd'),
       "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe", 32},
      {key4, std::string(50, '\xcd'), "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b", 32},
      {std::string(20, '\x0c'), "Test With Truncation", "a3b6167473100ee06e0c796c2955552b", 16},
      {std::string(131, '\xaa'), "Test Using Larger Than Block-Size Key - Hash Key First",
       "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54", 32},
      {std::string(131, '\xaa'),
       "This is a test using a larger than block-size key and a larger than block-size data. The key "
       "needs to be hashed before being used by the HMAC algorithm.",
       "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2", 32},
  };
  int n = 0;
  for (const auto& c : cases) {
    ++n;
    const Digest d = fthsdp::crypto::hmac_sha256(c.key.data(), c.key.size(), c.data.data(), c.data.size());
    check(hex(d, c.bytes) == c.want, "RFC 4231 test case " + std::to_string(n) + ": " + hex(d, c.bytes));
    // The same MAC from a reusable key, the message given in three parts.
    const fthsdp::crypto::HmacKey k(c.key);
    const size_t a = c.data.size() / 3, b = c.data.size() / 2;
    const Digest parts = k.mac(c.data.data(), a, c.data.data() + a, b - a, c.data.data() + b, c.data.size() - b);
    check(parts == d, "RFC 4231 test case " + std::to_string(n) + " in three parts");
  }
  check(fthsdp::crypto::HmacKey().empty() && !fthsdp::crypto::HmacKey("k").empty(), "HmacKey::empty");
}

void compare_and_random() {
  const uint8_t a[4] = {1, 2, 3, 4}, b[4] = {1, 2, 3, 4}, c[4] = {1, 2, 3, 5};
  check(fthsdp::crypto::equal_ct(a, b, 4), "equal_ct of equal strings");
  check(!fthsdp::crypto::equal_ct(a, c, 4), "equal_ct of different strings");
  check(fthsdp::crypto::equal_ct(a, c, 0), "equal_ct of empty strings");
  uint8_t r1[16] = {}, r2[16] = {};
  fthsdp::crypto::random_bytes(r1, sizeof(r1));
  fthsdp::crypto::random_bytes(r2, sizeof(r2));
  check(std::memcmp(r1, r2, sizeof(r1)) != 0, "two random nonces differ");
}

}  // namespace

int main() {
  sha256_vectors();
  hmac_vectors();
  compare_and_random();
  if (failures) {
    std::fprintf(stderr, "%d failure(s)\n", failures);
    return 1;
  }
  std::printf("hmac_sha256_test: ok\n");
  return 0;
}
