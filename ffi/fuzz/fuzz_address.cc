// libFuzzer harness: "host:port" as FTAR reads a member's address
// (wire::split_host_port, which tcp::parse_address resolves afterwards).
//
// Properties: never crashes; an accepted address is exactly host + ":" + port
// text (or "[" + host + "]:" + port for an IPv6 literal, whose host has a ':')
// with a non-empty host and a port in 0..65535, and join_host_port gives it
// back; a refusal says why.
#include <cstdlib>
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
    const bool bracketed = host.find(':') != std::string::npos;
    const size_t at = bracketed ? 1 : 0;
    FUZZ_CHECK(!bracketed || address[0] == '[');
    FUZZ_CHECK(address.compare(at, host.size(), host) == 0);
    const size_t colon = at + host.size() + (bracketed ? 1 : 0);
    FUZZ_CHECK(!bracketed || address[colon - 1] == ']');
    FUZZ_CHECK(address[colon] == ':' && address.find(':', colon + 1) == std::string::npos);
    FUZZ_CHECK(std::strtol(address.c_str() + colon + 1, nullptr, 10) == port);
    FUZZ_CHECK(wire::join_host_port(host, port).size() <= address.size());
  } else {
    FUZZ_CHECK(!error.empty() && host.empty() && port == -1);
  }
  return 0;
}
