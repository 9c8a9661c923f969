// C symbols of fthsdp's XLA FFI handlers. They are the whole public ABI of the
// native library: the nanobind module hands them to jax as capsules, and the
// Bazel-built shared library exports them for ctypes users.
#pragma once

#include "xla/ffi/api/c_api.h"

extern "C" {
// out = a + b (f32 / bf16 / f16), same shape and dtype.
XLA_FFI_Error* FthsdpReduceSum(XLA_FFI_CallFrame* call_frame);
// FTAR: (comm, shard, quorum_id, rank, num_members: int32 scalars, buffers...)
//   -> (status: int32[1], sums...). Sums every buffer over the ring of `shard`
// of communicator `comm`; status 0 OK, 1 RECOVERABLE; fatal errors raise.
XLA_FFI_Error* FthsdpFtar(XLA_FFI_CallFrame* call_frame);
// State fingerprint of one device's blocks: (meta: uint32[], leaves...) -> uint32[2]
// (attrs leaf_ids, ranks, global_dims; fthsdp/step/fingerprint.py builds the call).
XLA_FFI_Error* FthsdpFingerprint(XLA_FFI_CallFrame* call_frame);
}
