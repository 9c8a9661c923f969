// libFuzzer harness: "host:port" as FTAR reads a member's address
// (wire::split_host_port, which tcp::parse_address resolves afterwards).
//
// Properties: never crashes; an accepted address is exactly host + ":" + port
// text with a non-empty host and a port in 0..65535; a refusal says why.
#include <string>

#include "fuzz_check.h"
#include "transport/wire.h"

using namespace fthsdp;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string address(reinterpret_cast<const char*>(data), size);
  std::string host, error;
  long port = -1;
  if (wire::split_host_port(address, &host, &port, &error)) {
    FUZZ_CHECK(!host.empty() && port >= 0 && port <= 65535 && error.empty());
    FUZZ_CHECK(address.compare(0, host.size(), host) == 0 && address[host.size()] == ':');
    FUZZ_CHECK(address.find(':', host.size() + 1) == std::string::npos);
  } else {
    FUZZ_CHECK(!error.empty() && host.empty() && port == -1);
  }
  return 0;
}
