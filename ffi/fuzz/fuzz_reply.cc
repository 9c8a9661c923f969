// libFuzzer harness: the handshake reply, as the connecting rank reads it.
//
// Input: the first sizeof(Reply) bytes are the record a (possibly hostile)
// right neighbour sends; the rest is a reason string for the round trip.
// Properties: read_reply accepts exactly ok == kReplyAccepted, reads a
// challenge exactly for ok == kReplyChallenge, "busy" exactly for
// ok == kReplyBusy, gives every other reply a
// non-empty refusal reason, never reads past the reason field (an
// unterminated reason is cut at the field's end), and make_reply/read_reply
// round-trip a reason up to the field's size.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstring>
#include <string>

#include "fuzz_check.h"
#include "transport/wire.h"

using namespace fthsdp;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < sizeof(tcp::Reply)) return 0;
  tcp::Reply r;
  FUZZ_CHECK(wire::decode_reply(data, sizeof(tcp::Reply), &r));
  const wire::ReplyDecision d = wire::read_reply(r);
  FUZZ_CHECK(d.accepted == (r.ok == tcp::kReplyAccepted));
  FUZZ_CHECK(d.challenge == (r.ok == tcp::kReplyChallenge));
  FUZZ_CHECK(d.busy == (r.ok == tcp::kReplyBusy));
  FUZZ_CHECK(!(d.accepted && d.challenge));
  FUZZ_CHECK(d.reason.size() <= tcp::kReasonMax);
  FUZZ_CHECK(d.reason.find('\0') == std::string::npos);
  if (d.accepted || d.challenge) FUZZ_CHECK(d.reason.empty());
  if (!d.accepted && !d.challenge) {
    FUZZ_CHECK(!d.reason.empty());
    const size_t n = strnlen(r.reason, tcp::kReasonMax);
    if ((r.ok == tcp::kReplyRefused || r.ok == tcp::kReplyBusy) && n > 0) {
      FUZZ_CHECK(d.reason.compare(0, std::string::npos, r.reason, d.reason.size()) == 0);
    }
  }

  FuzzedDataProvider fdp(data + sizeof(tcp::Reply), size - sizeof(tcp::Reply));
  const bool ok = fdp.ConsumeBool();
  const std::string reason = fdp.ConsumeRemainingBytesAsString();
  const wire::ReplyDecision b = wire::read_reply(wire::make_busy(reason));
  FUZZ_CHECK(b.busy && !b.accepted && !b.challenge && !b.reason.empty());
  const wire::ReplyDecision back = wire::read_reply(wire::make_reply(ok, reason));
  FUZZ_CHECK(back.accepted == ok);
  if (!ok) {
    const std::string expect = reason.substr(0, std::min(reason.find('\0'), tcp::kReasonMax - 1));
    FUZZ_CHECK(expect.empty() ? !back.reason.empty() : back.reason == expect);
  }
  return 0;
}
