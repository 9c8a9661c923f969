// libFuzzer harness: the FTAR handshake hello, as the receiving rank judges it.
//
// Input: the first sizeof(Hello) bytes are the record on the wire (anything a
// stranger can send); the rest describe the receiver (configured or not, job,
// quorum, ring size, rank, streams, taken slots, failed). A flags byte lets the
// receiver copy fields from the hello itself, so the fuzzer reaches the accept
// path and every refusal, not only "bad magic".
//
// Properties: check_hello never crashes, refuses with a non-empty reason, and
// accepts only a hello that matches the receiver in every field with a free
// slot and the same authentication setting (a peer without the job key is
// refused by a rank that has one, and the reverse); a refusal reason survives the Reply record (truncated, NUL-terminated);
// the hello a configured left neighbour sends (make_hello) is accepted.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstring>
#include <string>
#include <vector>

#include "fuzz_check.h"
#include "transport/wire.h"

using namespace fthsdp;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < sizeof(tcp::Hello)) return 0;
  tcp::Hello h;
  FUZZ_CHECK(wire::decode_hello(data, sizeof(tcp::Hello), &h));
  FUZZ_CHECK(!wire::decode_hello(data, sizeof(tcp::Hello) - 1, &h));
  FuzzedDataProvider fdp(data + sizeof(tcp::Hello), size - sizeof(tcp::Hello));

  const uint8_t copy = fdp.ConsumeIntegral<uint8_t>();  // which fields mirror the hello
  wire::HelloExpect e;
  e.configured = fdp.ConsumeBool();
  e.job_id = (copy & 1) ? wire::fixed_str(h.job_id) : fdp.ConsumeRandomLengthString(80);
  e.quorum_id = (copy & 2) ? h.quorum_id : fdp.ConsumeIntegral<int64_t>();
  e.n = (copy & 4) ? h.n : fdp.ConsumeIntegralInRange<int32_t>(1, 1 << 20);
  e.streams = (copy & 8) ? h.streams : fdp.ConsumeIntegralInRange<int32_t>(1, 64);
  if (e.n < 1) e.n = 1;
  if (e.streams < 1 || e.streams > 64) e.streams = 1 + (e.streams & 63);
  e.rank = fdp.ConsumeIntegralInRange<int32_t>(0, e.n - 1);
  e.left = static_cast<int32_t>((int64_t{e.rank} + e.n - 1) % e.n);
  if ((copy & 16) && h.rank >= 0 && h.rank < e.n) {  // the hello's sender is this rank's left neighbour
    e.rank = static_cast<int32_t>((int64_t{h.rank} + 1) % e.n);
    e.left = h.rank;
  }
  const int32_t slots = fdp.ConsumeBool() ? e.streams : fdp.ConsumeIntegralInRange<int32_t>(0, 64);
  for (int32_t s = 0; s < slots; ++s) e.taken.push_back(fdp.ConsumeBool());
  e.failed = fdp.ConsumeBool();
  e.failed_reason = fdp.ConsumeRandomLengthString(300);
  e.auth = (copy & 32) ? h.auth == 1 : fdp.ConsumeBool();

  const wire::HelloDecision d = wire::check_hello(h, e);
  switch (d.verdict) {
    case wire::HelloVerdict::kAccept:
      FUZZ_CHECK(h.magic == tcp::kHelloMagic && h.version == tcp::kProtocolVersion);
      FUZZ_CHECK(e.configured && !e.failed);
      FUZZ_CHECK(h.auth == (e.auth ? 1u : 0u));
      FUZZ_CHECK(wire::fixed_str(h.job_id) == e.job_id);
      FUZZ_CHECK(h.quorum_id == e.quorum_id && h.n == e.n && e.n >= 2 && h.rank == e.left);
      FUZZ_CHECK(h.streams == e.streams && h.stream >= 0 && h.stream < e.streams);
      FUZZ_CHECK(static_cast<size_t>(h.stream) < e.taken.size() && !e.taken[h.stream]);
      FUZZ_CHECK(d.reason.empty());
      break;
    case wire::HelloVerdict::kHold:
      FUZZ_CHECK(h.magic == tcp::kHelloMagic && h.version == tcp::kProtocolVersion);
      FUZZ_CHECK(!e.configured || h.quorum_id > e.quorum_id);
      break;
    case wire::HelloVerdict::kRefuse: {
      FUZZ_CHECK(!d.reason.empty());
      const tcp::Reply r = wire::make_reply(false, d.reason);
      const wire::ReplyDecision back = wire::read_reply(r);
      FUZZ_CHECK(!back.accepted);
      FUZZ_CHECK(back.reason.size() < tcp::kReasonMax);
      FUZZ_CHECK(d.reason.compare(0, back.reason.size(), back.reason) == 0);
      break;
    }
  }

  // The hello an honest left neighbour sends is accepted by a configured,
  // healthy receiver with that slot free.
  if (e.configured && !e.failed && e.n >= 2 && !e.job_id.empty() && e.job_id.size() < tcp::kJobIdMax &&
      e.job_id.find('\0') == std::string::npos) {
    const int32_t stream = fdp.ConsumeIntegralInRange<int32_t>(0, e.streams - 1);
    wire::HelloExpect free_slot = e;
    free_slot.taken.assign(static_cast<size_t>(e.streams), false);
    const tcp::Hello honest = wire::make_hello(e.job_id, e.quorum_id, e.left, e.n, stream, e.streams, e.auth);
    FUZZ_CHECK(wire::check_hello(honest, free_slot).verdict == wire::HelloVerdict::kAccept);
  }
  return 0;
}
