// Thin XLA FFI bindings: decode buffers, validate, call into the pure kernels.
#include "handlers.h"

#include <string>
#include <vector>

#include "fingerprint.h"
#include "ftar.h"
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

ffi::ErrorOr<int32_t> scalar_i32(ffi::Buffer<ffi::S32> b, const char* name) {
  if (b.element_count() != 1) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        std::string("fthsdp ftar fatal: ") + name + " must be a single int32, got " +
        std::to_string(b.element_count()) + " elements"));
  }
  return b.typed_data()[0];
}

ffi::Error FtarImpl(ffi::Buffer<ffi::S32> comm, ffi::Buffer<ffi::S32> shard,
                    ffi::Buffer<ffi::S32> quorum_id, ffi::Buffer<ffi::S32> rank,
                    ffi::Buffer<ffi::S32> num_members, ffi::RemainingArgs args,
                    ffi::Result<ffi::Buffer<ffi::S32>> status, ffi::RemainingRets rets) {
  int32_t v[5];
  const ffi::Buffer<ffi::S32>* in[5] = {&comm, &shard, &quorum_id, &rank, &num_members};
  const char* names[5] = {"comm", "shard", "quorum_id", "rank", "num_members"};
  for (int i = 0; i < 5; ++i) {
    auto r = scalar_i32(*in[i], names[i]);
    if (r.has_error()) return r.error();
    v[i] = r.value();
  }
  if (status->element_count() != 1) {
    return ffi::Error::InvalidArgument("fthsdp ftar fatal: status output must hold one int32");
  }
  if (args.size() != rets.size()) {
    return ffi::Error::InvalidArgument("fthsdp ftar fatal: " + std::to_string(args.size()) +
                                       " buffers in but " + std::to_string(rets.size()) + " out");
  }
  std::vector<FtarBuffer> buffers;
  for (size_t i = 0; i < args.size(); ++i) {
    auto a = args.get<ffi::AnyBuffer>(i);
    auto r = rets.get<ffi::AnyBuffer>(i);
    if (a.has_error()) return a.error();
    if (r.has_error()) return r.error();
    FtarBuffer b;
    if (!to_dtype(a.value().element_type(), &b.dtype)) {
      return ffi::Error::InvalidArgument(
          "fthsdp ftar fatal: buffer " + std::to_string(i) +
          " has an unsupported dtype (supported: float32, bfloat16, float16)");
    }
    if ((*r.value()).element_type() != a.value().element_type() ||
        (*r.value()).element_count() != a.value().element_count()) {
      return ffi::Error::InvalidArgument("fthsdp ftar fatal: output " + std::to_string(i) +
                                         " must match its input's dtype and size");
    }
    b.in = a.value().untyped_data();
    b.out = (*r.value()).untyped_data();
    b.count = static_cast<int64_t>(a.value().element_count());
    buffers.push_back(b);
  }
  const FtarResult res = ftar_allreduce(v[0], v[1], v[2], v[3], v[4], buffers);
  if (res.fatal) return ffi::Error::Internal("fthsdp ftar fatal: " + res.reason);
  status->typed_data()[0] = static_cast<int32_t>(res.status);
  return ffi::Error::Success();
}

// Byte size of a fingerprintable element type, or 0.
int fingerprint_elem_bytes(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::PRED: case ffi::DataType::S8: case ffi::DataType::U8: return 1;
    case ffi::DataType::F16: case ffi::DataType::BF16: case ffi::DataType::S16: case ffi::DataType::U16: return 2;
    case ffi::DataType::F32: case ffi::DataType::S32: case ffi::DataType::U32: return 4;
    case ffi::DataType::F64: case ffi::DataType::S64: case ffi::DataType::U64: return 8;
    default: return 0;
  }
}

// meta: uint32, per leaf [counted (0/1), offset of each axis...] (this device's block);
// attrs: leaf_ids, ranks, global_dims (all leaves' dims, concatenated).
ffi::Error FingerprintImpl(ffi::Buffer<ffi::U32> meta, ffi::RemainingArgs leaves,
                           ffi::Span<const int64_t> leaf_ids, ffi::Span<const int64_t> ranks,
                           ffi::Span<const int64_t> global_dims, ffi::Result<ffi::Buffer<ffi::U32>> out) {
  const std::string what = "fthsdp fingerprint: ";
  if (out->element_count() != 2) return ffi::Error::InvalidArgument(what + "the output must hold two uint32 words");
  if (leaf_ids.size() != leaves.size() || ranks.size() != leaves.size()) {
    return ffi::Error::InvalidArgument(what + std::to_string(leaves.size()) + " leaves but " +
                                       std::to_string(leaf_ids.size()) + " leaf ids and " +
                                       std::to_string(ranks.size()) + " ranks");
  }
  std::vector<FpBlock> blocks;
  blocks.reserve(leaves.size());
  size_t m = 0, g = 0;
  const uint32_t* mv = meta.typed_data();
  for (size_t i = 0; i < leaves.size(); ++i) {
    auto a = leaves.get<ffi::AnyBuffer>(i);
    if (a.has_error()) return a.error();
    const auto dims = a.value().dimensions();
    const int64_t rank = ranks[i];
    if (rank > kFpMaxRank) {
      return ffi::Error::InvalidArgument(what + "leaf " + std::to_string(i) + " has rank " + std::to_string(rank) +
                                         ", more than the kernel's " + std::to_string(kFpMaxRank) +
                                         " (fingerprint it with the jax reference instead)");
    }
    if (rank != static_cast<int64_t>(dims.size()) || g + rank > global_dims.size() ||
        m + 1 + rank > meta.element_count()) {
      return ffi::Error::InvalidArgument(what + "leaf " + std::to_string(i) + " has rank " +
                                         std::to_string(dims.size()) + ", its description does not match");
    }
    const int bytes = fingerprint_elem_bytes(a.value().element_type());
    if (bytes == 0) return ffi::Error::InvalidArgument(what + "leaf " + std::to_string(i) + " has an unsupported dtype");
    for (int64_t d = 0; d < rank; ++d) {
      if (dims[d] < 0 || global_dims[g + d] < 0 || mv[m + 1 + d] + dims[d] > global_dims[g + d]) {
        return ffi::Error::InvalidArgument(what + "leaf " + std::to_string(i) + ": a block past its global shape");
      }
    }
    if (mv[m] != 0) {  // counted on this device (a replicated leaf: on one device only)
      FpBlock b;
      b.data = a.value().untyped_data();
      b.elem_bytes = bytes;
      b.leaf = static_cast<uint32_t>(leaf_ids[i]);
      b.rank = static_cast<int>(rank);
      b.local_dims = dims.begin();
      b.global_dims = global_dims.begin() + g;
      b.offsets = mv + m + 1;
      blocks.push_back(b);
    }
    m += 1 + rank;
    g += rank;
  }
  uint32_t* o = out->typed_data();
  o[0] = o[1] = 0;
  fingerprint_blocks(blocks, o);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace fthsdp

XLA_FFI_DEFINE_HANDLER_SYMBOL(FthsdpReduceSum, fthsdp::ReduceSumImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FthsdpFtar, fthsdp::FtarImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // comm
                                  .Arg<ffi::Buffer<ffi::S32>>()  // shard
                                  .Arg<ffi::Buffer<ffi::S32>>()  // quorum_id
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rank
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_members
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::S32>>()  // status
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FthsdpFingerprint, fthsdp::FingerprintImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()  // meta
                                  .RemainingArgs()               // the leaves' local blocks
                                  .Attr<ffi::Span<const int64_t>>("leaf_ids")
                                  .Attr<ffi::Span<const int64_t>>("ranks")
                                  .Attr<ffi::Span<const int64_t>>("global_dims")
                                  .Ret<ffi::Buffer<ffi::U32>>());
