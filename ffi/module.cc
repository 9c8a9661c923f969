// nanobind module `fthsdp._ffi`: hands the FFI handlers to jax as capsules and
// exposes the native control API to Python. No logic lives here.
#include <nanobind/nanobind.h>

#include "handlers.h"

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule as_capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_ffi, m) {
  m.doc() = "fthsdp native library: XLA FFI handlers and the FTAR control plane";
  m.attr("ABI_VERSION") = 1;
  m.def("registrations", []() {
    nb::dict d;
    d["fthsdp_reduce_sum"] = as_capsule(FthsdpReduceSum);
    return d;
  }, "Map of FFI target name -> handler capsule, for jax.ffi.register_ffi_target.");
}
