// Thin XLA FFI bindings: decode buffers, validate, call into the pure kernels.
#include "handlers.h"

#include <string>

#include "reduce.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace fthsdp {
namespace {

bool to_dtype(ffi::DataType t, DType* out) {
  switch (t) {
    case ffi::DataType::F32: *out = DType::kF32; return true;
    case ffi::DataType::BF16: *out = DType::kBF16; return true;
    case ffi::DataType::F16: *out = DType::kF16; return true;
    default: return false;
  }
}

ffi::Error ReduceSumImpl(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Result<ffi::AnyBuffer> out) {
  DType dtype;
  if (!to_dtype(a.element_type(), &dtype)) {
    return ffi::Error::InvalidArgument(
        "fthsdp reduce_sum: unsupported dtype (supported: float32, bfloat16, float16)");
  }
  if (b.element_type() != a.element_type() || out->element_type() != a.element_type()) {
    return ffi::Error::InvalidArgument("fthsdp reduce_sum: operands must share one dtype");
  }
  if (b.element_count() != a.element_count() || out->element_count() != a.element_count()) {
    return ffi::Error::InvalidArgument(
        "fthsdp reduce_sum: operands must have the same number of elements, got " +
        std::to_string(a.element_count()) + " and " + std::to_string(b.element_count()));
  }
  reduce_sum(dtype, a.untyped_data(), b.untyped_data(), out->untyped_data(), a.element_count());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace fthsdp

XLA_FFI_DEFINE_HANDLER_SYMBOL(FthsdpReduceSum, fthsdp::ReduceSumImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
