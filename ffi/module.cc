// nanobind module `fthsdp._ffi`: hands the FFI handlers to jax as capsules and
// exposes the native control API to Python. No logic lives here.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include "ftar.h"
#include "transport/wire.h"
#include "ring_schedule.h"
#include "staging.h"

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
    d["fthsdp_ftar"] = as_capsule(FthsdpFtar);
    d["fthsdp_fingerprint"] = as_capsule(FthsdpFingerprint);
    return d;
  }, "Map of FFI target name -> handler capsule, for jax.ffi.register_ffi_target.");
  m.def("host_api_address", []() { return reinterpret_cast<uintptr_t>(fthsdp_host_api()); },
        "Address of the staging C table (ffi/staging_abi.h) that the CUDA library's "
        "FthsdpCudaInit takes: the GPU handler reaches this module's control plane through it.");
  m.attr("STAGING_ABI") = FTHSDP_STAGING_ABI;

  // ---- FTAR control API (thin: the logic lives in ffi/ftar.cc) ----
  m.def("ftar_create",
        [](int num_shards, const std::string& listen_host, int streams, int64_t chunk_bytes,
           int chunks, double timeout_s, int socket_buffer_bytes, nb::bytes key) {
          fthsdp::RingOptions o;
          o.key.assign(key.c_str(), key.size());
          o.listen_host = listen_host;
          o.streams = streams;
          o.chunk_bytes = chunk_bytes;
          o.chunks = chunks;
          o.timeout_s = timeout_s;
          o.socket_buffer_bytes = socket_buffer_bytes;
          return fthsdp::ftar_create(num_shards, o);
        },
        nb::arg("num_shards"), nb::arg("listen_host"), nb::arg("streams"), nb::arg("chunk_bytes"),
        nb::arg("chunks"), nb::arg("timeout_s"), nb::arg("socket_buffer_bytes"), nb::arg("key"),
        "Creates a communicator (one ring endpoint per local shard); returns its handle. "
        "key: the job's FTAR key (empty bytes: no authentication).");
  auto get = [](int32_t handle) {
    auto c = fthsdp::ftar_get(handle);
    if (!c) throw std::invalid_argument("unknown ftar communicator handle " + std::to_string(handle));
    return c;
  };
  m.def("ftar_addresses", [get](int32_t h) { return get(h)->addresses(); });
  m.def("ftar_configure",
        [get](int32_t h, const std::string& job_id, int64_t quorum_id, int32_t rank,
              const std::vector<std::string>& members, double connect_timeout_s, double op_timeout_s) {
          auto c = get(h);
          nb::gil_scoped_release release;  // (a DNS lookup of the right neighbour may take a while)
          c->configure(job_id, quorum_id, rank, members, connect_timeout_s, op_timeout_s);
        });
  m.def("ftar_wait_configured",
        [get](int32_t h, double timeout_s) {
          auto c = get(h);
          nb::gil_scoped_release release;
          return c->wait_configured(timeout_s);
        });
  m.def("ftar_abort", [get](int32_t h, const std::string& reason) { get(h)->abort(reason); });
  m.def("ftar_set_op_timeout", [get](int32_t h, double seconds) { get(h)->set_op_timeout(seconds); });
  m.def("ftar_destroy", [](int32_t h) { return fthsdp::ftar_destroy(h); });
  m.def("ftar_stats", [get](int32_t h) {
    nb::list out;
    for (const auto& s : get(h)->stats()) {
      nb::dict d;
      d["state"] = s.state;
      d["ops_ok"] = s.ops_ok;
      d["ops_recoverable"] = s.ops_recoverable;
      d["ops_fatal"] = s.ops_fatal;
      d["bytes_sent"] = s.bytes_sent;
      d["bytes_received"] = s.bytes_received;
      d["configures"] = s.configures;
      d["refused_handshakes"] = s.refused_handshakes;
      d["violations"] = s.violations;
      d["chunk_mac_ns"] = s.chunk_mac_ns;
      d["chunk_macs"] = s.chunk_macs;
      d["last_error"] = s.last_error;
      out.append(d);
    }
    return out;
  });
  m.def("ftar_progress", [get](int32_t h) {
    nb::list out;
    for (const auto& p : get(h)->progress()) {
      nb::dict d;
      d["in_op"] = p.in_op;
      d["op_seq"] = p.op_seq;
      d["rank"] = p.rank;
      d["n"] = p.n;
      d["ring_step"] = p.ring_step;
      d["ring_steps"] = p.ring_steps;
      d["recv_done"] = p.recv_done;
      d["recv_total"] = p.recv_total;
      d["sends_queued"] = p.sends_queued;
      d["op_s"] = p.op_s;
      d["since_recv_s"] = p.since_recv_s;
      d["bytes_sent"] = p.bytes_sent;
      d["send_busy_s"] = p.send_busy_s;
      d["bytes_received"] = p.bytes_received;
      out.append(d);
    }
    return out;
  }, "Per shard: where its ring endpoint is in its all-reduce (lock-free; see RingProgress).");
  m.def("ftar_take_violations", [get](int32_t h) {
    nb::list out;
    for (const auto& [shard, v] : get(h)->take_violations()) {
      nb::dict d;
      d["shard"] = shard;
      d["quorum_id"] = v.quorum_id;
      d["rank"] = v.rank;
      d["address"] = v.address;
      d["reason"] = v.reason;
      out.append(d);
    }
    return out;
  }, "Protocol violations by ring neighbours since the last call.");
  m.def("chunk_tag_seconds",
        [](int64_t iters) {
          // What authentication adds per chunk on each side: one tag (sender) or one
          // check (receiver) of a chunk header under a connection key.
          const fthsdp::crypto::HmacKey conn(std::string(32, 'k'));
          fthsdp::tcp::ChunkHeader h{};
          h.magic = fthsdp::tcp::kChunkMagic;
          h.bytes = 1 << 20;
          uint64_t ok = 0;
          const auto t0 = std::chrono::steady_clock::now();
          for (int64_t i = 0; i < iters; ++i) {
            h.index = i;
            fthsdp::wire::tag_chunk(conn, static_cast<uint64_t>(i), &h);
            ok += fthsdp::wire::check_chunk_tag(conn, static_cast<uint64_t>(i), h);
          }
          const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          if (ok != static_cast<uint64_t>(iters)) throw std::runtime_error("chunk tag did not verify");
          return s / static_cast<double>(std::max<int64_t>(1, iters)) / 2.0;
        },
        nb::arg("iters"), "Seconds to tag (or check) one chunk header: the per-chunk cost of authentication.");
  m.def("hmac_sha256",
        [](nb::bytes key, nb::bytes data) {
          const auto d = fthsdp::crypto::hmac_sha256(key.c_str(), key.size(), data.c_str(), data.size());
          return nb::bytes(reinterpret_cast<const char*>(d.data()), d.size());
        },
        "HMAC-SHA256 with FTAR's own SHA-256: the lighthouse and its clients MAC requests up to 4 KiB with it "
        "(fthsdp.control.auth; one native call is cheaper than hashlib's keyed state there).");
  m.def("ftar_allreduce_host",
        [](int32_t h, int32_t shard, int64_t quorum_id, int32_t rank, int32_t n,
           nb::ndarray<nb::c_contig, nb::device::cpu> a) {
          fthsdp::FtarBuffer b;
          const auto dt = a.dtype();
          if (dt == nb::dtype<float>()) {
            b.dtype = fthsdp::DType::kF32;
          } else if (dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) && dt.bits == 16) {
            b.dtype = fthsdp::DType::kF16;
          } else if (dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) && dt.bits == 16) {
            b.dtype = fthsdp::DType::kBF16;
          } else {
            throw std::invalid_argument("ftar_allreduce_host: float32/float16/bfloat16 arrays only");
          }
          b.in = a.data();
          b.out = a.data();
          b.count = static_cast<int64_t>(a.size());
          fthsdp::FtarResult r;
          {
            nb::gil_scoped_release release;
            r = fthsdp::ftar_allreduce(h, shard, quorum_id, rank, n, {b});
          }
          if (r.fatal) throw std::runtime_error(r.reason);
          return std::make_pair(static_cast<int>(r.status), r.reason);
        },
        nb::arg("h"), nb::arg("shard"), nb::arg("quorum_id"), nb::arg("rank"), nb::arg("n"),
        nb::arg("a").noconvert(),  // a converted copy would be summed, the caller's array left as it was
        "In-place all-reduce of a C-contiguous host array, outside XLA (tests, benchmarks).");
  m.def("ring_schedule",
        [](int64_t count, int64_t chunk_elems, int32_t chunks, int32_t n, int32_t rank) {
          fthsdp::RingSchedule s(count, chunk_elems, chunks, n, rank);
          nb::list out;
          for (int32_t lane = 0; lane < s.lanes(); ++lane) {
            for (int64_t i = 0; i < s.steps_per_lane(); ++i) {
              const auto c = s.lane_step(lane, i);
              out.append(nb::make_tuple(c.lane, i, c.partition, c.step, c.send_segment,
                                        c.recv_segment, c.send.offset, c.send.count,
                                        c.recv.offset, c.recv.count, static_cast<int>(c.op)));
            }
          }
          return nb::make_tuple(s.num_partitions(), s.steps_per_partition(), out);
        },
        "The pure ring schedule: (partitions, steps per partition, [(lane, index, partition, "
        "step, send_seg, recv_seg, send_off, send_count, recv_off, recv_count, op)]).");
}
