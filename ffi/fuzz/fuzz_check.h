// Shared by the libFuzzer harnesses in ffi/fuzz/: a property check that
// aborts (which libFuzzer records as a crash, with the input saved) instead of
// an assert that -DNDEBUG would compile away.
#pragma once

#include <cstdio>
#include <cstdlib>

#define FUZZ_CHECK(cond)                                                              \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      std::fprintf(stderr, "FUZZ_CHECK failed at %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                   \
    }                                                                                 \
  } while (0)
